"""Test files run in a pytest subprocess: under one of the plugins in ``tests/``
(``pool_everything``, ``stream_everything``, ``sample_everything``), which change accel for
the whole process they are loaded in, or with an environment of their own."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


#: The test session's store (conftest set ACCEL_CACHE_DIR before any test module imported
#: this one), where conftest's fixture builds or loads the dispatch filter.
SESSION_STORE = os.environ.get("ACCEL_CACHE_DIR")


def seed_dispatch_filter(directory, source=SESSION_STORE) -> bool:
    """Put the dispatch filter of the store at ``source`` (the session's store by default,
    whatever store a test switched to) into the store at ``directory``, so that a process
    with that store loads it instead of building it again (about 100 s of a core on the dev
    VM). Returns whether there was one to put."""
    import accel.dispatch
    from accel.store import Store

    key = accel.dispatch.store_key()
    entry = Store(str(source)).get(key)
    if entry is None or entry.negative:
        return False
    with open(entry.path, "rb") as f:
        Store(str(directory)).put(key, f.read(), {**entry.meta, "readable": "dispatch filter (seeded)"})
    return True


def run_under(plugin, files, *args, **env) -> str:
    """Run ``files`` (names in ``tests/``) with ``-p plugin`` (None: none) and pytest
    arguments ``args``, the environment updated by ``env``; assert that all passed. Returns
    pytest's stdout."""
    # not an xdist worker: conftest would give the run a store below ACCEL_CACHE_DIR, empty
    # (every kernel and the dispatch filter built again)
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}, **env,
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *(("-p", plugin) if plugin else ()), *args, *(os.path.join(HERE, f) for f in files)],
                       capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout
    return r.stdout
