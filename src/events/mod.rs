//! Engine KV-event feeds: decoders that turn what inference engines publish into
//! [`KvEvent`](crate::blocks::KvEvent)s for the block index.
//!
//! * `msgpack` (feature `vllm`): a small, dependency-free, panic-free MessagePack reader, the
//!   decoder's lower layer.
//! * `vllm` (feature `vllm`): the decoder for vLLM's `KVEventBatch` payloads, accepting every
//!   encoding vLLM has shipped (see `vllm::decode_batch`).
//! * `zmq` (feature `zmq`): the live subscriber to vLLM's ZMQ publishers (replay, sequence
//!   checks, reconnects), applying the decoded events to a block index.

#[cfg(feature = "vllm")]
#[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
pub mod msgpack;

#[cfg(feature = "vllm")]
pub mod vllm;

#[cfg(feature = "zmq")]
pub mod zmq;
