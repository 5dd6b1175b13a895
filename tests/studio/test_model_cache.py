"""The model cache: a key loads once under concurrent requests, the oldest is evicted, errors are not
cached."""

from __future__ import annotations

import threading
import time

import pytest

from vptq_core.studio.model_cache import ModelCache


def test_model_cache_loads_once_evicts_and_does_not_cache_errors():
    cache = ModelCache(max_items=2)
    calls: list = []
    started = threading.Barrier(4)

    def slow_loader():
        calls.append(1)
        time.sleep(0.2)
        return object()

    results = []

    def worker():
        started.wait()
        results.append(cache.get("a", slow_loader))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1
    cache.get("b", lambda: 2)
    cache.get("a", slow_loader)  # touch: "b" is now the oldest
    cache.get("c", lambda: 3)
    assert "a" in cache and "c" in cache and "b" not in cache
    with pytest.raises(RuntimeError, match="disk on fire"):
        cache.get("d", lambda: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    assert "d" not in cache and cache.get("d", lambda: 4) == 4
    assert "a" not in cache  # evicted by "d"
    assert cache.drop(lambda k: k in ("c", "d")) == 2 and "c" not in cache and "d" not in cache
