//! Arbitrary bytes → the vLLM KV-event decoder (and the raw msgpack reader).
//!
//! Properties checked on every input:
//! - nothing panics (libFuzzer also reports stack overflows, OOMs and timeouts);
//! - decoding is deterministic, and a fresh stateful `Decoder` agrees with `decode_batch`;
//! - a batch that decodes for router block size 4 also decodes for block size 1, with the same
//!   events and skipped (and malformed) events in all (a store's block size may split into one
//!   router size and not the other: then it is skipped there), and, when neither skipped a
//!   store for its block size, every stored engine block split into 4× as many router blocks;
//! - a strict prefix of a payload that decodes does not decode;
//! - in the raw msgpack layer, a value that tree-decodes can also be skipped.
//!
//! Seeds in `corpus/kv_event_decode/` are plain batch payloads (the shared test vectors and a
//! few variants), so captured production payloads can be dropped in as they are.
#![no_main]

use kvtrie::blocks::KvEvent;
use kvtrie::events::msgpack::{Reader, Value};
use kvtrie::events::vllm::{decode_batch, DecodeConfig, Decoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|payload: &[u8]| {
    let cfg4 = DecodeConfig::new(4);
    let cfg1 = DecodeConfig::new(1);

    let r4 = decode_batch(payload, &cfg4);
    // Compared through `{:?}`: a NaN timestamp is a valid decode but never equals itself.
    let same = |a: &_, b: &_| format!("{a:?}") == format!("{b:?}");
    assert!(same(&r4, &decode_batch(payload, &cfg4)), "not deterministic");
    let mut dec = Decoder::new(cfg4.clone()).expect("valid config");
    assert!(
        same(&dec.decode(payload), &r4),
        "Decoder disagrees with decode_batch"
    );

    if let Ok(b4) = &r4 {
        // The router block size only decides which stores are skipped for their block size.
        let b1 = match decode_batch(payload, &cfg1) {
            Ok(b1) => b1,
            Err(e) => panic!("decodes with block size 4 but not 1: {e}"),
        };
        assert_eq!(
            b1.events.len() + b1.skipped_block_sizes,
            b4.events.len() + b4.skipped_block_sizes
        );
        assert_eq!(b1.skipped_groups, b4.skipped_groups);
        assert_eq!(b1.skipped_unknown, b4.skipped_unknown);
        assert_eq!(b1.skipped_remote, b4.skipped_remote);
        assert_eq!(b1.skipped_malformed, b4.skipped_malformed);
        let aligned = b1.skipped_block_sizes + b4.skipped_block_sizes == 0;
        for (e1, e4) in b1.events.iter().zip(&b4.events).filter(|_| aligned) {
            match (&e1.event, &e4.event) {
                (
                    KvEvent::Stored {
                        parent: p1,
                        blocks: s1,
                    },
                    KvEvent::Stored {
                        parent: p4,
                        blocks: s4,
                    },
                ) => {
                    assert_eq!(p1, p4);
                    assert_eq!(s1.len(), 4 * s4.len());
                }
                (KvEvent::Removed { .. }, KvEvent::Removed { .. })
                | (KvEvent::Cleared, KvEvent::Cleared) => {}
                (a, b) => panic!("event kinds differ: {a:?} vs {b:?}"),
            }
        }
        if let Some((_, prefix)) = payload.split_last() {
            assert!(
                decode_batch(prefix, &cfg4).is_err(),
                "a strict prefix decoded"
            );
        }
    }

    let tree = Reader::new(payload).read_value();
    let skip = Reader::new(payload).skip_value();
    if tree.is_ok() {
        assert!(skip.is_ok(), "tree decoded but skip failed");
    }
    let _ = Value::decode(payload);
});
