"""The live vLLM KV-event subscriber over ZeroMQ.

:class:`Subscriber` runs one background thread per engine (:class:`EngineConfig`): it
connects a SUB socket to the engine's publisher, decodes every batch and applies it to a
:class:`kvtrie.BlockIndex`, detecting sequence gaps and filling them from the engine's replay
socket, and reconnecting after errors. The threads never need the GIL.

>>> import kvtrie
>>> index = kvtrie.BlockIndex(kvtrie.BlockHasher(16))
>>> engines = [kvtrie.zmq.EngineConfig("tcp://127.0.0.1:5557", worker=0,
...                                    replay_endpoint="tcp://127.0.0.1:5558")]
>>> with kvtrie.zmq.Subscriber(index, engines) as sub:  # doctest: +SKIP
...     ...  # route with index.find_matches(...) / kvtrie.KvAwareRouter(index=index)
...     print(sub.stats())

Available when kvtrie was built with the ``zmq`` feature (the published wheel is); check
``kvtrie.HAS_ZMQ``.
"""

from kvtrie import _kvtrie

if _kvtrie.HAS_ZMQ:
    EngineConfig = _kvtrie.EngineConfig
    Subscriber = _kvtrie.Subscriber
else:  # pragma: no cover - only in builds without the feature

    class _Missing:
        def __init__(self, *args, **kwargs):
            raise ImportError(
                "kvtrie was built without the `zmq` feature: "
                "rebuild with `maturin build --features zmq`"
            )

    class EngineConfig(_Missing):  # type: ignore[no-redef]
        """Unavailable: kvtrie was built without the ``zmq`` feature."""

    class Subscriber(_Missing):  # type: ignore[no-redef]
        """Unavailable: kvtrie was built without the ``zmq`` feature."""


__all__ = ["EngineConfig", "Subscriber"]
