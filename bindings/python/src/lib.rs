//! The `kvtrie` Python module (`kvtrie._kvtrie`): kvtrie's concurrent prefix tree, block
//! index, routers and vLLM KV-event decoding for Python.
//!
//! Every call that walks or changes a structure releases the GIL (`Python::detach`); every
//! class is frozen (immutable from Python) and synchronizes internally, so objects can be
//! shared between Python threads.

mod blocks;
mod events;
mod routers;
mod tree;
mod util;

use pyo3::prelude::*;

#[pymodule]
fn _kvtrie(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // The importing process owns the dropper thread (not a child forked before first use).
    util::claim_dropper();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HAS_ZMQ", cfg!(feature = "zmq"))?;
    m.add("HAS_NATS", cfg!(feature = "nats"))?;
    m.add("MAX_TEXT_BYTES", kvtrie::MAX_TEXT_BYTES)?;
    m.add("MAX_TENANTS", kvtrie::MAX_TENANTS)?;
    // The prefix tree (Ray's drop-in) and its char-count view.
    m.add_class::<tree::PyPrefixTree>()?;
    m.add_class::<tree::TenantCharCounts>()?;
    // Routers and their configurations.
    m.add_class::<routers::PyEvictionConfig>()?;
    m.add_class::<routers::PyPrefixAffinityConfig>()?;
    m.add_class::<routers::PyPrefixAffinityRouter>()?;
    m.add_class::<routers::PyRoute>()?;
    m.add_class::<routers::PyKvAwareConfig>()?;
    m.add_class::<routers::PyKvAwareRouter>()?;
    m.add_class::<routers::PySelection>()?;
    m.add("RouteError", py.get_type::<routers::RouteError>())?;
    // KV blocks.
    m.add_class::<blocks::PyBlockHasher>()?;
    m.add_class::<blocks::PyBlockIndex>()?;
    m.add_class::<blocks::PyStoredBlock>()?;
    m.add_class::<blocks::PyKvEvent>()?;
    m.add(
        "UnknownParentError",
        py.get_type::<blocks::UnknownParentError>(),
    )?;
    // vLLM KV events.
    m.add_function(wrap_pyfunction!(events::decode_vllm_batch, m)?)?;
    m.add_class::<events::PyDecoder>()?;
    m.add_class::<events::PyDecodedBatch>()?;
    m.add_class::<events::PyDecodedEvent>()?;
    let decode_error = py.get_type::<events::KvEventDecodeError>();
    // The decoder sets it on each error it raises; one raised by hand reads `None`, as the
    // stub says (it raised `AttributeError`).
    decode_error.setattr("event_index", py.None())?;
    m.add("KvEventDecodeError", decode_error)?;
    #[cfg(feature = "zmq")]
    {
        m.add_class::<events::PyEngineConfig>()?;
        m.add_class::<events::PySubscriber>()?;
    }
    Ok(())
}
