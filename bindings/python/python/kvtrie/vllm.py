"""Decoding of vLLM's KV-cache event batches (``KVEventBatch``, msgpack).

Every encoding vLLM has shipped is accepted (array or map batches; array- or map-encoded
events, even mixed); a payload that is not whole msgpack, or not a batch, raises
:class:`DecodeError` (a ``ValueError``), never crashes, and an event malformed in its values
is dropped alone and counted (``DecodedBatch.skipped_malformed``). Decoded events are
:class:`kvtrie.KvEvent` values in router blocks, ready for :meth:`kvtrie.BlockIndex.apply`.

>>> import kvtrie
>>> from kvtrie import vllm
>>> payload = open("batch_map_events.msgpack", "rb").read()  # doctest: +SKIP
>>> batch = vllm.decode_batch(payload, block_size=4)  # doctest: +SKIP
>>> index = kvtrie.BlockIndex(kvtrie.BlockHasher(4))  # doctest: +SKIP
>>> for ev in batch.events:  # doctest: +SKIP
...     index.apply(0, ev.event)
"""

from kvtrie._kvtrie import DecodedBatch, DecodedEvent, Decoder
from kvtrie._kvtrie import KvEventDecodeError as DecodeError
from kvtrie._kvtrie import decode_vllm_batch as decode_batch

__all__ = ["DecodeError", "DecodedBatch", "DecodedEvent", "Decoder", "decode_batch"]
