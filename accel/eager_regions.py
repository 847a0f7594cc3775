"""Regions that run eagerly where fusing them would cost the host more than it saves: small
regions (a few calls over little memory, on any device) and idle regions (a GPU that has
already run everything queued before the region). Both rules decide once per trie node of
a region's first call (``TrieNode.eager_first``); from then on that call runs eagerly, on
the interceptor's path and the dispatch filter's alike, and the calls after it start the
next region. :func:`accel.interceptor._flush_region` applies them at each flush.
"""
from __future__ import annotations

import logging

import torch

from . import dispatch, runtime

log = logging.getLogger("accel")


#: Small regions: a region of at most SMALL_REGION_CALLS calls whose kernel reads and writes
#: fewer than SMALL_REGION_BYTES[device type] bytes costs the host more (recording its calls,
#: then a flush: 10-30 µs) than eager spends on the calls it replaces, and saves the device
#: less than that (its intermediates' traffic). The first flush of a region that began with
#: a given call decides, for that call's trie node (``TrieNode.eager_first``); where it was
#: small, the call runs eagerly from then on, on the mode's path and the dispatch filter's
#: alike, and the calls after it start the next region (``ACCEL_EAGER_SMALL_REGIONS``).
SMALL_REGION_CALLS = 3
SMALL_REGION_BYTES = {"cpu": 64 << 10, "cuda": 16 << 20}


def decide_small(region, node) -> bool:
    """Decide ``eager_first`` for the first trie node of ``region`` (of ``node.depth`` <=
    SMALL_REGION_CALLS calls, ending at ``node``), before its flush; whether it is small.
    A small region's flush runs its calls eagerly too: a kernel built for it would never
    run again (its first call runs eagerly from now on), and a build costs the first
    flush 0.2-1 s (a generation's slices of a growing cache, of a new stride each token:
    64 of its 79 builds, each run once)."""
    head = node
    while head.depth > 1:
        head = head.parent
    if head.eager_first is not None:
        return head.eager_first
    dev = region.device
    limit = SMALL_REGION_BYTES.get("cpu" if dev is None else dev.type, 0)
    traffic = region.traffic()
    head.eager_first = small = traffic < limit
    if small:
        dispatch.eager_first(head)
        log.debug("accel: a small region (%d calls, %d bytes) begins with %s: it runs eagerly",
                  node.depth, traffic, region.calls[0][0])
    return small


#: Idle regions (GPU): a region whose flush finds its GPU idle -- done with all the work
#: queued on the stream before it -- shortens nothing by being fused: the program is bound
#: by the host there, and recording and flushing the region's calls costs the host more
#: than running them eagerly (the demo's GPT-2 step on the H100: 0.78x of eager's speed
#: with its regions fused, 0.84-0.86x with this rule). Once IDLE_FLUSHES flushes in a row
#: of regions that began with a given call found the GPU idle, that call runs eagerly from
#: then on (``TrieNode.eager_first``, as for small regions) and the calls after it start
#: the next region, sampled alike; one flush that finds the GPU busy keeps the regions
#: beginning there fused for good. While a region is sampled it runs eagerly: no kernel is built for
#: it until a flush finds the GPU busy. Regions reading and writing IDLE_REGION_BYTES or
#: more are not sampled: their kernel saves enough GPU time that a program that waits for
#: the results (synchronizing after each call, say) gains from it even where the GPU was
#: idle when the region began (``ACCEL_EAGER_IDLE_REGIONS``; needs
#: ``ACCEL_EAGER_SMALL_REGIONS``, whose mechanism it shares).
IDLE_FLUSHES = 4
IDLE_REGION_BYTES = 64 << 20


def device_idle(device):
    """Whether ``device`` has run all the work queued on its current stream (a GPU);
    None where the question does not arise (a CPU runs its kernels on the calling thread;
    a CUDA graph is being captured) or the query fails (an error of earlier work: the
    region's launch reports it, naming the region)."""
    if device is None or device.type != "cuda":
        return None
    try:
        if torch.cuda.is_current_stream_capturing():
            return None  # a query would end the capture; the graph's replays gain from fusion
        return torch.cuda.current_stream(device).query()
    except RuntimeError:
        return None


def sample_idle(region, node) -> bool:
    """The idle-region rule at a flush of ``region`` (ending at trie node ``node``, its
    kernel not launched yet): samples the GPU, and decides the region's first call's
    ``eager_first`` where IDLE_FLUSHES samples in a row found it idle. Returns True where
    it ran the region's calls eagerly and emptied it (a region still sampled, or just
    decided, with no kernel in memory)."""
    head = node
    while head.depth > 1:
        head = head.parent
    idle = None
    if head.idle >= 0 and head.eager_first is not True and region.traffic() < IDLE_REGION_BYTES:
        region.busy = True  # (Stream.query's hook flushes: not this region)
        try:
            idle = device_idle(region.device)
        finally:
            region.busy = False
    if idle is None:
        node.idle = -1  # not sampled: nothing to do at this node from now on
        return False
    if not idle:
        head.idle = node.idle = -1
        return False
    head.idle += 1
    if head.idle >= IDLE_FLUSHES:
        head.eager_first = True
        dispatch.eager_first(head)
        log.debug("accel: regions beginning with %s flushed %d times in a row with the GPU "
                  "idle: the call runs eagerly", region.calls[0][0], head.idle)
    if region.speculation is not None or region.liveness() in node.kernels:
        # its kernel is in memory, or was launched ahead at its first call (where
        # ACCEL_LAUNCH_AHEAD_MIN_MB is below IDLE_REGION_BYTES): flushed as usual
        return False
    run_and_reset(region, runtime.run_eagerly)
    return True


def run_and_reset(region, flush_fn) -> None:
    """Flush ``region`` with ``flush_fn`` (its calls pass through meanwhile), then empty it."""
    region.busy = True
    try:
        flush_fn(region)
    finally:
        region.reset()
        region.busy = False
