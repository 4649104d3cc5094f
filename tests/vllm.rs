//! vLLM KV-event decoder: the shared test vectors, hand-built variants of every encoding the
//! decoder accepts, and robustness (truncations, garbage) — errors, never panics.
#![cfg(all(feature = "vllm", not(loom)))]

use kvtrie::blocks::{
    BlockHasher, BlockIndex, CacheKeys, KvEvent, MmInput, StoredBlock, Tier, WorkerId,
};
use kvtrie::events::vllm::{
    decode_batch, sub_block_hash, DecodeConfig, DecodeError, DecodeErrorKind, DecodedBatch,
    DecodedEvent, Decoder, MAX_SUB_BLOCKS,
};

// ---------------------------------------------------------------------------------------------
// test vectors

const MAP_EVENTS: &[u8] = include_bytes!("data/vllm/batch_map_events.msgpack");
const ARRAY_EVENTS: &[u8] = include_bytes!("data/vllm/batch_array_events.msgpack");
const ALL_MAPS: &[u8] = include_bytes!("data/vllm/batch_all_maps.msgpack");
const VECTORS: [(&str, &[u8]); 3] = [
    ("batch_map_events.msgpack", MAP_EVENTS),
    ("batch_array_events.msgpack", ARRAY_EVENTS),
    ("batch_all_maps.msgpack", ALL_MAPS),
];

const H1: u64 = 2_164_874_634_404_590_027;
const H2: u64 = 17_270_480_062_156_288_726;
const TOKENS: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

fn cfg4() -> DecodeConfig {
    DecodeConfig::new(4)
}

fn gpu(event: KvEvent, group_idx: Option<u64>) -> DecodedEvent {
    DecodedEvent {
        event,
        medium: Some("GPU".to_owned()),
        group_idx,
    }
}

/// The batch documented in shared/testdata/vllm/README.md.
fn expected_batch() -> DecodedBatch {
    let local = BlockHasher::new(4).local_hashes(&TOKENS);
    assert_eq!(local.len(), 2);
    DecodedBatch {
        ts: 1_700_000_000.5,
        data_parallel_rank: Some(0),
        events: vec![
            gpu(
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![
                        StoredBlock {
                            engine_hash: H1,
                            local_hash: local[0],
                        },
                        StoredBlock {
                            engine_hash: H2,
                            local_hash: local[1],
                        },
                    ],
                },
                Some(0),
            ),
            gpu(
                KvEvent::Removed {
                    engine_hashes: vec![H2],
                },
                Some(0),
            ),
            DecodedEvent {
                event: KvEvent::Cleared,
                medium: None,
                group_idx: None,
            },
        ],
        skipped_groups: 0,
        skipped_unknown: 0,
        skipped_block_sizes: 0,
        skipped_remote: 0,
        skipped_malformed: 0,
        malformed: None,
    }
}

#[test]
fn test_vectors_decode_to_the_documented_batch() {
    for (name, bytes) in VECTORS {
        let got = decode_batch(bytes, &cfg4()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, expected_batch(), "{name}");
    }
}

#[test]
fn in_repo_vectors_match_shared_copies() {
    // CI has ../shared beside the clone; elsewhere this check is skipped.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/testdata/vllm/");
    for (name, bytes) in VECTORS {
        if let Ok(shared) = std::fs::read(format!("{dir}{name}")) {
            assert_eq!(shared, bytes, "{name} differs from the shared copy");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// a tiny msgpack writer for hand-built payloads

#[derive(Clone, Debug)]
enum M {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(String),
    B(Vec<u8>),
    A(Vec<M>),
    Map(Vec<(M, M)>),
    /// Bytes written as they are (bools, `float 32`, ext types).
    Raw(Vec<u8>),
}

fn s(x: &str) -> M {
    M::S(x.to_owned())
}

fn kv(k: &str, v: M) -> (M, M) {
    (s(k), v)
}

fn u(x: u64) -> M {
    M::U(x)
}

fn tokens(t: &[u32]) -> M {
    M::A(t.iter().map(|&x| u(u64::from(x))).collect())
}

fn hashes(h: &[u64]) -> M {
    M::A(h.iter().map(|&x| u(x)).collect())
}

fn header(out: &mut Vec<u8>, len: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
    if len <= fix_max {
        out.push(fix | len as u8);
    } else if len <= 0xffff {
        out.push(m16);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(m32);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

fn enc_into(m: &M, out: &mut Vec<u8>) {
    match m {
        M::Nil => out.push(0xc0),
        M::U(v) => match *v {
            0..=0x7f => out.push(*v as u8),
            0x80..=0xff => out.extend_from_slice(&[0xcc, *v as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend_from_slice(&(*v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend_from_slice(&(*v as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend_from_slice(&v.to_be_bytes());
            }
        },
        M::I(v) => {
            if (-32..0).contains(v) {
                out.push(*v as i8 as u8);
            } else {
                out.push(0xd3);
                out.extend_from_slice(&v.to_be_bytes());
            }
        }
        M::F(v) => {
            out.push(0xcb);
            out.extend_from_slice(&v.to_be_bytes());
        }
        M::S(x) => {
            let b = x.as_bytes();
            if b.len() < 32 {
                out.push(0xa0 | b.len() as u8);
            } else if b.len() <= 0xff {
                out.extend_from_slice(&[0xd9, b.len() as u8]);
            } else {
                out.push(0xda);
                out.extend_from_slice(&(b.len() as u16).to_be_bytes());
            }
            out.extend_from_slice(b);
        }
        M::B(b) => {
            assert!(b.len() <= 0xff);
            out.extend_from_slice(&[0xc4, b.len() as u8]);
            out.extend_from_slice(b);
        }
        M::A(items) => {
            header(out, items.len(), 0x90, 15, 0xdc, 0xdd);
            items.iter().for_each(|i| enc_into(i, out));
        }
        M::Map(items) => {
            header(out, items.len(), 0x80, 15, 0xde, 0xdf);
            for (k, v) in items {
                enc_into(k, out);
                enc_into(v, out);
            }
        }
        M::Raw(bytes) => out.extend_from_slice(bytes),
    }
}

fn enc(m: &M) -> Vec<u8> {
    let mut out = Vec::new();
    enc_into(m, &mut out);
    out
}

/// Current-layout map-encoded `BlockStored`.
#[allow(clippy::too_many_arguments)]
fn stored_map(
    block_hashes: M,
    parent: M,
    token_ids: &[u32],
    block_size: u64,
    lora_name: M,
    group_idx: u64,
    kind: &str,
) -> M {
    M::Map(vec![
        kv("type", s("BlockStored")),
        kv("block_hashes", block_hashes),
        kv("parent_block_hash", parent),
        kv("token_ids", tokens(token_ids)),
        kv("block_size", u(block_size)),
        kv("lora_id", M::Nil),
        kv("medium", s("GPU")),
        kv("lora_name", lora_name),
        kv("extra_keys", M::A(vec![M::Nil; 2])),
        kv("group_idx", u(group_idx)),
        kv("kv_cache_spec_kind", s(kind)),
    ])
}

fn removed_map(block_hashes: M, group_idx: u64) -> M {
    M::Map(vec![
        kv("type", s("BlockRemoved")),
        kv("block_hashes", block_hashes),
        kv("medium", s("GPU")),
        kv("group_idx", u(group_idx)),
    ])
}

fn cleared_map() -> M {
    M::Map(vec![kv("type", s("AllBlocksCleared"))])
}

fn batch(events: Vec<M>) -> M {
    M::A(vec![M::F(1_700_000_000.5), M::A(events), u(0)])
}

fn the_stored() -> M {
    stored_map(
        hashes(&[H1, H2]),
        M::Nil,
        &TOKENS,
        4,
        M::Nil,
        0,
        "full_attention",
    )
}

fn stored_event(b: &DecodedBatch, i: usize) -> (Option<u64>, Vec<StoredBlock>) {
    match &b.events[i].event {
        KvEvent::Stored { parent, blocks } => (*parent, blocks.clone()),
        other => panic!("event {i} is {other:?}"),
    }
}

fn engine_hashes(blocks: &[StoredBlock]) -> Vec<u64> {
    blocks.iter().map(|b| b.engine_hash).collect()
}

fn local_hashes(blocks: &[StoredBlock]) -> Vec<u64> {
    blocks.iter().map(|b| b.local_hash).collect()
}

/// Every hand-built valid payload, for the truncation and mutation sweeps.
fn built_payloads() -> Vec<Vec<u8>> {
    vec![
        enc(&batch(vec![
            the_stored(),
            removed_map(hashes(&[H2]), 0),
            cleared_map(),
        ])),
        enc(&mixed_batch()),
        enc(&batch(vec![stored_map(
            M::A(vec![M::I(-1), M::B(vec![1, 2, 3])]),
            M::I(-5),
            &TOKENS,
            4,
            s("adapter"),
            0,
            "full_attention",
        )])),
        enc(&older_layout_batch()),
    ]
}

// ---------------------------------------------------------------------------------------------
// shapes

#[test]
fn writer_reproduces_the_map_vector() {
    let built = enc(&batch(vec![
        the_stored(),
        removed_map(hashes(&[H2]), 0),
        cleared_map(),
    ]));
    assert_eq!(built, MAP_EVENTS, "the test writer encodes like msgspec");
}

/// Map batch holding a map event, an array event and an array event.
fn mixed_batch() -> M {
    M::Map(vec![
        kv("data_parallel_rank", u(0)),
        kv(
            "events",
            M::A(vec![
                the_stored(),
                M::A(vec![s("BlockRemoved"), hashes(&[H2]), s("GPU"), u(0)]),
                M::A(vec![s("AllBlocksCleared")]),
            ]),
        ),
        kv("ts", M::F(1_700_000_000.5)),
    ])
}

#[test]
fn mixed_shapes_in_one_batch() {
    let got = decode_batch(&enc(&mixed_batch()), &cfg4()).unwrap();
    assert_eq!(got, expected_batch());
}

#[test]
fn unknown_keys_and_extra_trailing_elements_are_ignored() {
    let mut stored = the_stored();
    if let M::Map(items) = &mut stored {
        items.insert(
            1,
            kv("future_field", M::Map(vec![kv("x", M::A(vec![u(1)]))])),
        );
        items.push((u(7), M::B(vec![0; 4]))); // non-string key
        items.push(kv("kv_cache_spec_sliding_window", M::Nil));
    }
    let removed = M::A(vec![
        s("BlockRemoved"),
        hashes(&[H2]),
        s("GPU"),
        u(0),
        s("extra"),
        M::A(vec![M::Nil, M::Map(vec![])]),
    ]);
    let cleared = M::A(vec![s("AllBlocksCleared"), u(1), u(2)]);
    let payload = M::A(vec![
        M::F(1_700_000_000.5),
        M::A(vec![stored, removed, cleared]),
        u(0),
        s("trailing element"),
        M::Map(vec![kv("more", M::Nil)]),
    ]);
    assert_eq!(
        decode_batch(&enc(&payload), &cfg4()).unwrap(),
        expected_batch()
    );

    let map_batch = M::Map(vec![
        kv("ts", M::F(1_700_000_000.5)),
        kv("publisher", s("engine-0")),
        kv(
            "events",
            M::A(vec![
                the_stored(),
                removed_map(hashes(&[H2]), 0),
                cleared_map(),
            ]),
        ),
        kv("data_parallel_rank", u(0)),
    ]);
    assert_eq!(
        decode_batch(&enc(&map_batch), &cfg4()).unwrap(),
        expected_batch()
    );
}

/// The oldest array layout: `BlockStored = [tag, block_hashes, parent, token_ids, block_size,
/// lora_id]`, `BlockRemoved = [tag, block_hashes]`, batch `[ts, events]`.
fn older_layout_batch() -> M {
    M::A(vec![
        M::F(1_700_000_000.5),
        M::A(vec![
            M::A(vec![
                s("BlockStored"),
                hashes(&[H1, H2]),
                M::Nil,
                tokens(&TOKENS),
                u(4),
                M::Nil,
            ]),
            M::A(vec![s("BlockRemoved"), hashes(&[H2])]),
            M::A(vec![s("AllBlocksCleared")]),
        ]),
    ])
}

#[test]
fn missing_trailing_optional_fields_are_tolerated() {
    let got = decode_batch(&enc(&older_layout_batch()), &cfg4()).unwrap();
    let mut want = expected_batch();
    want.data_parallel_rank = None;
    for e in &mut want.events {
        e.medium = None;
        e.group_idx = None;
    }
    assert_eq!(got, want);

    // stored without lora_id at all, removed with medium only; dp rank nil; ts as an integer
    let payload = M::A(vec![
        u(1_700_000_000),
        M::A(vec![
            M::A(vec![
                s("BlockStored"),
                hashes(&[H1, H2]),
                M::Nil,
                tokens(&TOKENS),
                u(4),
            ]),
            M::A(vec![s("BlockRemoved"), hashes(&[H2]), s("CPU")]),
        ]),
        M::Nil,
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    assert_eq!(got.ts, 1_700_000_000.0);
    assert_eq!(got.data_parallel_rank, None);
    assert_eq!(got.events[0].event, want.events[0].event);
    assert_eq!(got.events[1].medium.as_deref(), Some("CPU"));
}

// ---------------------------------------------------------------------------------------------
// block hashes

#[test]
fn negative_int_hashes_reinterpret_bits() {
    let payload = batch(vec![
        stored_map(
            M::A(vec![M::I(-1), M::I(i64::MIN)]),
            M::I(-2),
            &TOKENS,
            4,
            M::Nil,
            0,
            "full_attention",
        ),
        removed_map(M::A(vec![M::I(-1)]), 0),
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    let (parent, blocks) = stored_event(&got, 0);
    assert_eq!(parent, Some(u64::MAX - 1));
    assert_eq!(engine_hashes(&blocks), vec![u64::MAX, 1 << 63]);
    assert_eq!(
        got.events[1].event,
        KvEvent::Removed {
            engine_hashes: vec![u64::MAX]
        }
    );
}

#[test]
fn bin_hashes_use_last_eight_bytes_big_endian() {
    let long: Vec<u8> = (1..=16).collect(); // last 8 bytes: 9..=16
    let payload = batch(vec![
        stored_map(
            M::A(vec![M::B(vec![0x01, 0x02, 0x03]), M::B(long)]),
            M::B(H1.to_be_bytes().to_vec()),
            &TOKENS,
            4,
            M::Nil,
            0,
            "full_attention",
        ),
        removed_map(M::A(vec![M::B(vec![]), M::B(vec![0xff; 8])]), 0),
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    let (parent, blocks) = stored_event(&got, 0);
    assert_eq!(parent, Some(H1));
    assert_eq!(
        engine_hashes(&blocks),
        vec![
            0x01_02_03,
            u64::from_be_bytes([9, 10, 11, 12, 13, 14, 15, 16])
        ]
    );
    assert_eq!(
        got.events[1].event,
        KvEvent::Removed {
            engine_hashes: vec![0, u64::MAX]
        }
    );
}

#[test]
fn other_hash_types_are_errors() {
    for bad in [s("abc"), M::F(1.0), M::Nil, M::A(vec![])] {
        let payload = batch(vec![removed_map(M::A(vec![bad.clone()]), 0)]);
        let err = malformed_event(&enc(&payload));
        assert!(
            matches!(
                err.kind,
                DecodeErrorKind::Msgpack {
                    field: "block_hashes",
                    ..
                }
            ),
            "{err}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// block size splitting

fn tokens64() -> Vec<u32> {
    (100..164).collect()
}

#[test]
fn engine_blocks_split_into_router_blocks() {
    let (e1, e2, parent) = (11u64, 22u64, 5u64);
    let toks = tokens64();
    let payload = batch(vec![
        stored_map(
            hashes(&[e1, e2]),
            u(parent),
            &toks,
            32,
            M::Nil,
            0,
            "full_attention",
        ),
        removed_map(hashes(&[e1, e2]), 0),
    ]);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(16)).unwrap();
    let (p, blocks) = stored_event(&got, 0);
    assert_eq!(p, Some(parent));
    // the last router block of each engine block carries the real engine hash
    assert_eq!(
        engine_hashes(&blocks),
        vec![sub_block_hash(e1, 0), e1, sub_block_hash(e2, 0), e2]
    );
    assert_eq!(
        local_hashes(&blocks),
        BlockHasher::new(16).local_hashes(&toks)
    );
    // removal expands to every router block, deepest first
    assert_eq!(
        got.events[1].event,
        KvEvent::Removed {
            engine_hashes: vec![e1, sub_block_hash(e1, 0), e2, sub_block_hash(e2, 0)]
        }
    );

    // k = 4
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(8)).unwrap();
    let (_, blocks) = stored_event(&got, 0);
    assert_eq!(blocks.len(), 8);
    assert_eq!(
        engine_hashes(&blocks[..4]),
        vec![
            sub_block_hash(e1, 0),
            sub_block_hash(e1, 1),
            sub_block_hash(e1, 2),
            e1
        ]
    );
    assert_eq!(
        local_hashes(&blocks),
        BlockHasher::new(8).local_hashes(&toks)
    );
    let KvEvent::Removed { engine_hashes } = &got.events[1].event else {
        panic!()
    };
    assert_eq!(
        engine_hashes[..4],
        [
            e1,
            sub_block_hash(e1, 2),
            sub_block_hash(e1, 1),
            sub_block_hash(e1, 0)
        ]
    );
    assert_eq!(engine_hashes.len(), 8);
    // synthetic hashes are distinct from each other and from the real ones
    let mut all = engine_hashes.clone();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 8);
}

#[test]
fn removal_expansion_across_batches_and_from_config() {
    let stored = enc(&batch(vec![stored_map(
        hashes(&[11]),
        M::Nil,
        &tokens64()[..32],
        32,
        M::Nil,
        0,
        "full_attention",
    )]));
    let removed = enc(&batch(vec![removed_map(hashes(&[11]), 0)]));
    let split = KvEvent::Removed {
        engine_hashes: vec![11, sub_block_hash(11, 0)],
    };

    // a stateful decoder remembers the engine block size
    let mut dec = Decoder::new(DecodeConfig::new(16)).unwrap();
    dec.decode(&stored).unwrap();
    assert_eq!(dec.decode(&removed).unwrap().events[0].event, split);

    // stateless: only from the config, else one router block per engine block
    let with_cfg = DecodeConfig::new(16).with_engine_block_size(32);
    assert_eq!(
        decode_batch(&removed, &with_cfg).unwrap().events[0].event,
        split
    );
    assert_eq!(
        decode_batch(&removed, &DecodeConfig::new(16))
            .unwrap()
            .events[0]
            .event,
        KvEvent::Removed {
            engine_hashes: vec![11]
        }
    );
}

/// A store whose block size does not split into the router's blocks is skipped and counted,
/// as Dynamo skips it, and the rest of the batch applies: an error there would lose the
/// batch's other stores and its removals (stale blocks in the index).
#[test]
fn block_sizes_that_do_not_split_into_router_blocks_are_skipped() {
    let removed = || removed_map(hashes(&[7]), 0);
    // not a multiple: 24-token engine blocks for 16-token router blocks
    let payload = batch(vec![
        cleared_map(),
        stored_map(
            hashes(&[1]),
            M::Nil,
            &tokens64()[..24],
            24,
            M::Nil,
            0,
            "full_attention",
        ),
        removed(),
    ]);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(16)).unwrap();
    let kinds: Vec<_> = got.events.iter().map(|e| e.event.clone()).collect();
    assert_eq!(
        kinds,
        [
            KvEvent::Cleared,
            KvEvent::Removed {
                engine_hashes: vec![7]
            }
        ]
    );
    assert_eq!(
        (
            got.skipped_block_sizes,
            got.skipped_groups,
            got.skipped_unknown
        ),
        (1, 0, 0)
    );

    // smaller engine blocks than router blocks: also not a multiple
    let payload = batch(vec![the_stored()]);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(8)).unwrap();
    assert_eq!((got.events.len(), got.skipped_block_sizes), (0, 1));

    // more than MAX_SUB_BLOCKS router blocks per engine block
    let toks: Vec<u32> = (0..130).collect();
    let payload = batch(vec![stored_map(
        hashes(&[1]),
        M::Nil,
        &toks,
        130,
        M::Nil,
        0,
        "full_attention",
    )]);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(2)).unwrap();
    assert_eq!((got.events.len(), got.skipped_block_sizes), (0, 1));
    assert_eq!(MAX_SUB_BLOCKS, 64);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(65)).unwrap();
    assert_eq!((got.events.len(), got.skipped_block_sizes), (1, 0));

    // A hybrid (attention + Mamba) engine with partial prefix caching: a full store of its
    // enlarged 1,056-token attention block (66 router blocks) next to a partial entry of its
    // 16-token hash block size and a removal. The partial store and the removal apply; the
    // skipped store teaches the decoder no block size (the removal is not expanded).
    let big: Vec<u32> = (0..1056).collect();
    let payload = batch(vec![
        stored_map(
            hashes(&[1]),
            M::Nil,
            &big,
            1056,
            M::Nil,
            0,
            "full_attention",
        ),
        stored_map(
            hashes(&[2]),
            M::Nil,
            &big[..16],
            16,
            M::Nil,
            0,
            "full_attention",
        ),
        removed(),
    ]);
    let mut dec = Decoder::new(DecodeConfig::new(16)).unwrap();
    let got = dec.decode(&enc(&payload)).unwrap();
    assert_eq!(got.skipped_block_sizes, 1);
    let h = BlockHasher::new(16);
    assert_eq!(
        got.events[0].event,
        KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: 2,
                local_hash: h.local_hashes(&big[..16])[0]
            }]
        }
    );
    assert_eq!(
        got.events[1].event,
        KvEvent::Removed {
            engine_hashes: vec![7]
        }
    );

    // engine block size 0, nothing stored: skipped too
    let payload = batch(vec![stored_map(
        hashes(&[]),
        M::Nil,
        &[],
        0,
        M::Nil,
        0,
        "full_attention",
    )]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    assert_eq!((got.events.len(), got.skipped_block_sizes), (0, 1));
}

/// An engine block of exactly [`MAX_SUB_BLOCKS`] router blocks is split, not skipped (only
/// more than that is): the last sub-block carries the engine hash, a removal expands to all
/// of them, and such an engine block size is a valid configuration.
#[test]
fn an_engine_block_of_exactly_max_sub_blocks_router_blocks_is_split() {
    let k = MAX_SUB_BLOCKS;
    let toks: Vec<u32> = (0..2 * k as u32).collect();
    let payload = batch(vec![
        stored_map(
            hashes(&[9]),
            M::Nil,
            &toks,
            2 * k as u64,
            M::Nil,
            0,
            "full_attention",
        ),
        removed_map(hashes(&[9]), 0),
    ]);
    let got = decode_batch(&enc(&payload), &DecodeConfig::new(2)).unwrap();
    assert_eq!((got.events.len(), got.skipped_block_sizes), (2, 0));
    let (_, blocks) = stored_event(&got, 0);
    let mut want: Vec<u64> = (0..k - 1).map(|i| sub_block_hash(9, i)).collect();
    want.push(9);
    assert_eq!(engine_hashes(&blocks), want);
    assert_eq!(
        local_hashes(&blocks),
        BlockHasher::new(2).local_hashes(&toks)
    );
    want.reverse();
    assert_eq!(
        got.events[1].event,
        KvEvent::Removed {
            engine_hashes: want.clone()
        }
    );
    let cfg = DecodeConfig::new(2).with_engine_block_size(2 * k);
    let removed = enc(&batch(vec![removed_map(hashes(&[9]), 0)]));
    let got = Decoder::new(cfg).unwrap().decode(&removed).unwrap();
    assert_eq!(
        got.events[0].event,
        KvEvent::Removed {
            engine_hashes: want
        }
    );
}

#[test]
fn token_count_mismatch_is_an_error() {
    // (no tokens at all is a placeholder, skipped: see `stores_without_tokens_are_skipped`)
    for toks in [&TOKENS[..7], &TOKENS[..4]] {
        let payload = batch(vec![stored_map(
            hashes(&[H1, H2]),
            M::Nil,
            toks,
            4,
            M::Nil,
            0,
            "full_attention",
        )]);
        let err = malformed_event(&enc(&payload));
        assert_eq!(
            err.kind,
            DecodeErrorKind::TokenCountMismatch {
                tokens: toks.len(),
                blocks: 2,
                block_size: 4
            }
        );
        assert_eq!(err.event, Some(0));
    }
    // Malformed whatever the router's block size: also when that block size does not split
    // the engine's (the store is not merely skipped).
    let payload = batch(vec![stored_map(
        hashes(&[H1, H2]),
        M::Nil,
        &TOKENS[..8],
        43,
        M::Nil,
        0,
        "full_attention",
    )]);
    for router in [1, 4] {
        let err = malformed_event_with(&enc(&payload), &DecodeConfig::new(router));
        assert!(
            matches!(err.kind, DecodeErrorKind::TokenCountMismatch { .. }),
            "{err}"
        );
    }
    // Likewise `extra_keys` that are not one entry per block: one 6-token block, two entries.
    let mut payload = stored_map(
        hashes(&[H1]),
        M::Nil,
        &tokens64()[..6],
        6,
        M::Nil,
        0,
        "full_attention",
    );
    if let M::Map(items) = &mut payload {
        for (k, v) in items.iter_mut() {
            if matches!(k, M::S(key) if key == "extra_keys") {
                *v = M::A(vec![M::A(vec![s("salt")]), M::Nil]);
            }
        }
    }
    let payload = batch(vec![payload]);
    for router in [1, 2, 4] {
        let err = malformed_event_with(&enc(&payload), &DecodeConfig::new(router));
        assert!(
            matches!(
                err.kind,
                DecodeErrorKind::InvalidValue {
                    field: "extra_keys",
                    ..
                }
            ),
            "router block size {router}: {err}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// groups, salting, unknown events

#[test]
fn non_full_attention_groups_are_skipped_and_counted() {
    let payload = batch(vec![
        stored_map(
            hashes(&[77]),
            M::Nil,
            &TOKENS[..4],
            4,
            M::Nil,
            1,
            "sliding_window",
        ),
        the_stored(),
        removed_map(hashes(&[77]), 1), // group 1 is known to be sliding window: skipped
        removed_map(hashes(&[H2]), 0),
        removed_map(hashes(&[5]), 2), // unknown group: kept
        cleared_map(),
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    assert_eq!(got.skipped_groups, 2);
    assert_eq!(got.events.len(), 4);
    assert_eq!(got.events[..2], expected_batch().events[..2]);
    assert_eq!(got.events[2].group_idx, Some(2));

    // the stateful decoder remembers the group across batches
    let mut dec = Decoder::new(cfg4()).unwrap();
    let first = dec.decode(&enc(&payload)).unwrap();
    assert_eq!(first.skipped_groups, 2);
    let later = dec
        .decode(&enc(&batch(vec![removed_map(hashes(&[77]), 1)])))
        .unwrap();
    assert_eq!((later.events.len(), later.skipped_groups), (0, 1));
}

/// Only a `BlockStored` reveals a group's kind: a removal that carries a
/// `kv_cache_spec_kind` of a skipped kind is dropped itself, but later removals of its group
/// that name no kind are kept (no store showed the group to be of a skipped kind).
#[test]
fn only_stores_teach_a_groups_kind() {
    let mut removed_with_kind = removed_map(hashes(&[77]), 1);
    if let M::Map(items) = &mut removed_with_kind {
        items.push(kv("kv_cache_spec_kind", s("sliding_window")));
    }
    let mut dec = Decoder::new(cfg4()).unwrap();
    let got = dec.decode(&enc(&batch(vec![removed_with_kind]))).unwrap();
    assert_eq!((got.events.len(), got.skipped_groups), (0, 1));
    let got = dec
        .decode(&enc(&batch(vec![removed_map(hashes(&[77]), 1)])))
        .unwrap();
    assert_eq!(got.skipped_groups, 0);
    assert_eq!(
        got.events[0].event,
        KvEvent::Removed {
            engine_hashes: vec![77]
        }
    );
}

/// Older releases publish `lora_id` alone, possibly as a negative int: it still salts the
/// local hashes (a LoRA's blocks are not the base model's, nor another LoRA's).
#[test]
fn a_negative_lora_id_salts_local_hashes() {
    let stored = |lora_id: M| {
        M::A(vec![
            s("BlockStored"),
            hashes(&[H1, H2]),
            M::Nil,
            tokens(&TOKENS),
            u(4),
            lora_id,
        ])
    };
    let local = |lora_id: M| {
        let got = decode_batch(&enc(&batch(vec![stored(lora_id)])), &cfg4()).unwrap();
        local_hashes(&stored_event(&got, 0).1)
    };
    let plain = BlockHasher::new(4).local_hashes(&TOKENS);
    assert_eq!(local(M::Nil), plain);
    let (minus_one, minus_two) = (local(M::I(-1)), local(M::I(-2)));
    assert_ne!(minus_one, plain);
    assert_ne!(minus_two, plain);
    assert_ne!(minus_one, minus_two);
    assert_ne!(minus_one, local(u(1)));
}

#[test]
fn lora_name_and_namespace_salt_local_hashes() {
    let payload = batch(vec![stored_map(
        hashes(&[H1, H2]),
        M::Nil,
        &TOKENS,
        4,
        s("my-adapter"),
        0,
        "full_attention",
    )]);
    let bytes = enc(&payload);
    let plain = BlockHasher::new(4).local_hashes(&TOKENS);

    let got = decode_batch(&bytes, &cfg4()).unwrap();
    let (_, blocks) = stored_event(&got, 0);
    let salted = BlockHasher::new(4)
        .with_salt("my-adapter", "")
        .local_hashes(&TOKENS);
    assert_eq!(local_hashes(&blocks), salted);
    assert_ne!(salted, plain);
    assert_eq!(engine_hashes(&blocks), vec![H1, H2]);

    let got = decode_batch(&bytes, &cfg4().with_namespace("tenant-a")).unwrap();
    let (_, blocks) = stored_event(&got, 0);
    let both = BlockHasher::new(4)
        .with_salt("my-adapter", "tenant-a")
        .local_hashes(&TOKENS);
    assert_eq!(local_hashes(&blocks), both);
    assert_ne!(both, salted);

    // namespace only (no lora_name)
    let got = decode_batch(MAP_EVENTS, &cfg4().with_namespace("tenant-a")).unwrap();
    let (_, blocks) = stored_event(&got, 0);
    assert_eq!(
        local_hashes(&blocks),
        BlockHasher::new(4)
            .with_salt("", "tenant-a")
            .local_hashes(&TOKENS)
    );
}

#[test]
fn unknown_event_types_are_skipped_and_counted() {
    let payload = batch(vec![
        M::Map(vec![
            kv("type", s("BlockPinned")),
            kv("block_hashes", hashes(&[1])),
        ]),
        the_stored(),
        M::A(vec![s("SomethingNew"), M::Map(vec![]), u(3)]),
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    assert_eq!(got.skipped_unknown, 2);
    assert_eq!(got.events, expected_batch().events[..1]);
}

/// vLLM ≥ 0.26 says where a tier's copy is (`locality`): a copy that is not `"LOCAL"` to the
/// publisher (a shared or remote pool) is not this worker's, and is dropped and counted, as
/// Dynamo drops it; `"LOCAL"` and no locality are indexed. A value of another type or an
/// unknown string fails closed.
#[test]
fn copies_not_local_to_the_publisher_are_skipped_and_counted() {
    let with_locality = |mut event: M, locality: M| {
        if let M::Map(items) = &mut event {
            items.push(kv("locality", locality));
        }
        event
    };
    let storage = |event: M| {
        let M::Map(items) = event else { unreachable!() };
        M::Map(
            items
                .into_iter()
                .map(|(k, v)| match k {
                    M::S(ref key) if key == "medium" => (k, s("STORAGE")),
                    _ => (k, v),
                })
                .collect(),
        )
    };
    let payload = batch(vec![
        with_locality(storage(the_stored()), s("REMOTE")),
        with_locality(storage(removed_map(hashes(&[H2]), 0)), s("REMOTE")),
        with_locality(the_stored(), s("LOCAL")),
        with_locality(removed_map(hashes(&[H2]), 0), s("local")),
        with_locality(the_stored(), M::Nil),
        with_locality(the_stored(), s("RACK")),
        with_locality(the_stored(), u(1)),
        cleared_map(),
    ]);
    let got = decode_batch(&enc(&payload), &cfg4()).unwrap();
    // (`cleared_map()` names no locality: kept.)
    assert_eq!(got.skipped_remote, 4);
    let expected = expected_batch().events;
    assert_eq!(
        got.events,
        [
            expected[0].clone(),
            expected[1].clone(),
            expected[0].clone(),
            expected[2].clone()
        ]
    );
    assert_eq!(
        (
            got.skipped_groups,
            got.skipped_unknown,
            got.skipped_block_sizes
        ),
        (0, 0, 0)
    );
    // A clear that names a remote pool is skipped too.
    let remote_clear = with_locality(cleared_map(), s("REMOTE"));
    let got = decode_batch(&enc(&batch(vec![remote_clear])), &cfg4()).unwrap();
    assert_eq!((got.events.len(), got.skipped_remote), (0, 1));

    // A skipped remote store teaches the decoder no block size: a later local removal of its
    // (8-token) engine block is not expanded into 4-token router blocks.
    let big = with_locality(
        stored_map(
            hashes(&[H1]),
            M::Nil,
            &TOKENS,
            8,
            M::Nil,
            0,
            "full_attention",
        ),
        s("REMOTE"),
    );
    let mut dec = Decoder::new(cfg4()).unwrap();
    assert_eq!(
        dec.decode(&enc(&batch(vec![big]))).unwrap().skipped_remote,
        1
    );
    let removal = dec
        .decode(&enc(&batch(vec![removed_map(hashes(&[H1]), 0)])))
        .unwrap();
    assert_eq!(
        removal.events[0].event,
        KvEvent::Removed {
            engine_hashes: vec![H1]
        }
    );
}

// ---------------------------------------------------------------------------------------------
// malformed input

/// The batch `bytes` decodes with its one event dropped as malformed; returns why.
fn malformed_event(bytes: &[u8]) -> DecodeError {
    malformed_event_with(bytes, &cfg4())
}

/// [`malformed_event`] under `cfg`.
fn malformed_event_with(bytes: &[u8], cfg: &DecodeConfig) -> DecodeError {
    let got = decode_batch(bytes, cfg).expect("the batch decodes");
    assert_eq!((got.events.len(), got.skipped_malformed), (0, 1), "{got:?}");
    let err = got.malformed.expect("the reason is kept");
    assert_eq!(err.event, Some(0));
    assert!(!err.to_string().is_empty());
    err
}

/// An event malformed in its values is dropped alone, counted, with its reason: the batch's
/// other events apply (an error for the whole batch lost them all, and the sequences that
/// chain from its stores). A connector publishing into the engine's batches (LMCache's 64-bit
/// hashes as token ids, vllm-ascend's `token_ids = None`) made every such batch fail.
#[test]
fn a_malformed_event_is_dropped_alone() {
    let mut wide = the_stored();
    if let M::Map(items) = &mut wide {
        items[3] = kv("token_ids", M::A(vec![u(1 << 33); 8]));
    }
    let b = batch(vec![
        removed_map(hashes(&[7]), 0),
        wide,
        the_stored(),
        M::A(vec![u(1)]),
    ]);
    let got = decode_batch(&enc(&b), &cfg4()).unwrap();
    assert_eq!(got.events.len(), 2);
    assert_eq!(got.skipped_malformed, 2);
    let err = got.malformed.unwrap();
    assert_eq!(err.event, Some(1), "the first is kept: {err}");
    assert!(err.to_string().contains("u32"), "{err}");
    // The stateful decoder likewise, and the store after the malformed one is indexed.
    let index = BlockIndex::new();
    let w = WorkerId(1);
    feed(&index, w, cfg4(), &[b]);
    assert_eq!(index.block_count(w), 2);
    // No `token_ids` at all (absent or nil) is a store without tokens: skipped as such.
    for token_ids in [None, Some(M::Nil)] {
        let mut ev = the_stored();
        if let M::Map(items) = &mut ev {
            match &token_ids {
                Some(v) => items[3] = kv("token_ids", v.clone()),
                None => {
                    items.remove(3);
                }
            }
        }
        let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
        assert_eq!(
            (got.events.len(), got.skipped_groups, got.skipped_malformed),
            (0, 1, 0),
            "{token_ids:?}"
        );
    }
    // A dropped malformed store teaches the decoder nothing of its group: group 1, known to
    // be a sliding window, stays one, and its removals stay skipped.
    let mut dec = Decoder::new(cfg4()).unwrap();
    let sw = stored_map(
        hashes(&[77]),
        M::Nil,
        &TOKENS[..4],
        4,
        M::Nil,
        1,
        "sliding_window",
    );
    let bad = stored_map(
        hashes(&[78, 79]),
        M::Nil,
        &TOKENS[..3],
        4,
        M::Nil,
        1,
        "full_attention",
    );
    for (b, want) in [(sw, (0, 1, 0)), (bad, (0, 0, 1))] {
        let got = dec.decode(&enc(&batch(vec![b]))).unwrap();
        let counts = (got.events.len(), got.skipped_groups, got.skipped_malformed);
        assert_eq!(counts, want);
    }
    let removal = dec
        .decode(&enc(&batch(vec![removed_map(hashes(&[77]), 1)])))
        .unwrap();
    assert_eq!((removal.events.len(), removal.skipped_groups), (0, 1));
    // A batch whose msgpack ends inside an event is still an error: its later events
    // cannot be found.
    let whole = enc(&batch(vec![the_stored(), the_stored()]));
    assert!(decode_batch(&whole[..whole.len() - 3], &cfg4()).is_err());
}

#[test]
fn malformed_batches_are_errors() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "empty"),
        (enc(&u(3)), "not a container"),
        (enc(&M::A(vec![])), "no ts"),
        (enc(&M::A(vec![M::F(1.0)])), "no events"),
        (
            enc(&M::Map(vec![kv("ts", M::F(1.0))])),
            "map without events",
        ),
        (
            enc(&M::Map(vec![kv("events", M::A(vec![]))])),
            "map without ts",
        ),
        (enc(&M::A(vec![s("ts"), M::A(vec![])])), "ts not a number"),
        (enc(&M::A(vec![M::F(1.0), M::Nil])), "events nil"),
        (
            enc(&M::A(vec![M::F(1.0), M::A(vec![]), M::I(-1)])),
            "negative dp rank",
        ),
        (
            enc(&M::A(vec![M::F(1.0), M::A(vec![]), u(1 << 40)])),
            "dp rank too large",
        ),
        (enc(&batch(vec![u(1)])), "[event] not a container"),
        (enc(&batch(vec![M::A(vec![])])), "[event] empty array"),
        (
            enc(&batch(vec![M::A(vec![u(1)])])),
            "[event] tag not a string",
        ),
        (
            enc(&batch(vec![M::Map(vec![])])),
            "[event] map without type",
        ),
        (
            enc(&batch(vec![M::Map(vec![kv("type", s("BlockStored"))])])),
            "[event] stored without fields",
        ),
        (
            enc(&batch(vec![M::A(vec![s("BlockRemoved")])])),
            "[event] removed without hashes",
        ),
        (
            enc(&batch(vec![stored_map(
                hashes(&[1]),
                M::Nil,
                &[1, 2, 3, u32::MAX],
                4,
                M::Nil,
                0,
                "full_attention",
            )]))
            .into_iter()
            .collect(),
            "(valid: u32::MAX token)",
        ),
        (
            {
                let mut ev = the_stored();
                if let M::Map(items) = &mut ev {
                    items[3] = kv("token_ids", M::A(vec![u(1 << 33); 8]));
                }
                enc(&batch(vec![ev]))
            },
            "[event] token id too large",
        ),
        (
            {
                let mut ev = the_stored();
                if let M::Map(items) = &mut ev {
                    items[3] = kv("token_ids", M::A(vec![M::I(-1); 8]));
                }
                enc(&batch(vec![ev]))
            },
            "[event] negative token id",
        ),
        (
            {
                let mut b = MAP_EVENTS.to_vec();
                b.push(0xc0);
                b
            },
            "trailing bytes",
        ),
        (
            enc(&M::Map(vec![
                kv("ts", M::F(1.0)),
                kv("events", M::A(vec![])),
                kv("events", M::A(vec![])),
            ])),
            "duplicate events",
        ),
    ];
    for (bytes, what) in cases {
        let r = decode_batch(&bytes, &cfg4());
        if what.starts_with("(valid") {
            assert!(r.is_ok(), "{what}: {r:?}");
        } else if what.starts_with("[event]") {
            malformed_event(&bytes);
        } else {
            let err = r.expect_err(what);
            assert!(!err.to_string().is_empty());
        }
    }
}

#[test]
fn invalid_configs_are_errors() {
    assert!(decode_batch(MAP_EVENTS, &DecodeConfig::new(0)).is_err());
    assert!(Decoder::new(DecodeConfig::new(16).with_engine_block_size(24)).is_err());
    assert!(Decoder::new(DecodeConfig::new(16).with_engine_block_size(0)).is_err());
    assert!(Decoder::new(DecodeConfig::new(16).with_engine_block_size(32)).is_ok());
    assert!(Decoder::new(DecodeConfig::new(1).with_engine_block_size(65)).is_err());
}

#[test]
fn every_truncation_is_an_error() {
    let mut all: Vec<Vec<u8>> = VECTORS.iter().map(|(_, b)| b.to_vec()).collect();
    all.extend(built_payloads());
    for bytes in &all {
        assert!(decode_batch(bytes, &DecodeConfig::new(1)).is_ok());
        for cut in 0..bytes.len() {
            assert!(
                decode_batch(&bytes[..cut], &DecodeConfig::new(1)).is_err(),
                "prefix of {cut}/{} bytes decoded",
                bytes.len()
            );
        }
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn garbage_and_mutations_never_panic() {
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let cfgs = [cfg4(), DecodeConfig::new(1), DecodeConfig::new(2)];
    // random bytes, biased towards msgpack container/str markers
    for _ in 0..20_000 {
        let len = (rng.next() % 64) as usize;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                let r = rng.next();
                match r % 4 {
                    0 => [0x93, 0x92, 0x81, 0xdd, 0xdf, 0xc4, 0xcf, 0xcb][(r >> 8) as usize % 8],
                    _ => (r >> 16) as u8,
                }
            })
            .collect();
        let _ = decode_batch(&bytes, &cfgs[len % 3]);
    }
    // byte mutations of every valid payload
    let mut all: Vec<Vec<u8>> = VECTORS.iter().map(|(_, b)| b.to_vec()).collect();
    all.extend(built_payloads());
    for base in &all {
        for _ in 0..3_000 {
            let mut b = base.clone();
            for _ in 0..=(rng.next() % 3) {
                let i = (rng.next() % b.len() as u64) as usize;
                b[i] = match rng.next() % 3 {
                    0 => b[i] ^ (1 << (rng.next() % 8)),
                    1 => rng.next() as u8,
                    _ => [0x00, 0xff, 0xc0, 0xdd, 0xdb, 0xc6][(rng.next() % 6) as usize],
                };
            }
            let r1 = decode_batch(&b, &cfg4());
            let r2 = decode_batch(&b, &cfg4());
            assert_eq!(format!("{r1:?}"), format!("{r2:?}"), "not deterministic");
        }
    }
}

#[test]
fn fuzz_seed_corpus_decodes() {
    // The seeds of fuzz/corpus/kv_event_decode are valid batches (skipped if the directory
    // is absent, e.g. in a packaged crate).
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/kv_event_decode");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut seen = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "msgpack") {
            let bytes = std::fs::read(&path).unwrap();
            let batch =
                decode_batch(&bytes, &cfg4()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(batch.ts, 1_700_000_000.5, "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen >= 3, "expected the seed corpus in {dir}");
}

// ---------------------------------------------------------------------------------------------
// issue 13: attention kinds, tiers, cache partitions, as engines send them

/// A `BlockStored` with every field, map-encoded (`array: false`) or array-encoded.
#[allow(clippy::too_many_arguments)]
fn stored_full(
    array: bool,
    block_hashes: &[u64],
    parent: Option<u64>,
    token_ids: &[u32],
    block_size: u64,
    medium: &str,
    lora_name: Option<&str>,
    extra_keys: M,
    group_idx: u64,
    kind: &str,
) -> M {
    let parent = parent.map_or(M::Nil, u);
    let lora = lora_name.map_or(M::Nil, s);
    if array {
        M::A(vec![
            s("BlockStored"),
            hashes(block_hashes),
            parent,
            tokens(token_ids),
            u(block_size),
            M::Nil,
            s(medium),
            lora,
            extra_keys,
            u(group_idx),
            s(kind),
            M::Nil,
        ])
    } else {
        M::Map(vec![
            kv("type", s("BlockStored")),
            kv("block_hashes", hashes(block_hashes)),
            kv("parent_block_hash", parent),
            kv("token_ids", tokens(token_ids)),
            kv("block_size", u(block_size)),
            kv("lora_id", M::Nil),
            kv("medium", s(medium)),
            kv("lora_name", lora),
            kv("extra_keys", extra_keys),
            kv("group_idx", u(group_idx)),
            kv("kv_cache_spec_kind", s(kind)),
        ])
    }
}

fn removed_full(array: bool, block_hashes: &[u64], medium: &str, group_idx: u64) -> M {
    if array {
        M::A(vec![
            s("BlockRemoved"),
            hashes(block_hashes),
            s(medium),
            u(group_idx),
        ])
    } else {
        M::Map(vec![
            kv("type", s("BlockRemoved")),
            kv("block_hashes", hashes(block_hashes)),
            kv("medium", s(medium)),
            kv("group_idx", u(group_idx)),
        ])
    }
}

/// Decodes `batches` with one stateful decoder and applies every event to `worker` in its
/// tier; returns the skipped-group count.
fn feed(index: &BlockIndex, worker: WorkerId, cfg: DecodeConfig, batches: &[M]) -> usize {
    let mut dec = Decoder::new(cfg).unwrap();
    let mut skipped = 0;
    for b in batches {
        let got = dec.decode(&enc(b)).unwrap();
        skipped += got.skipped_groups;
        for ev in got.events {
            index.apply_in(worker, ev.tier(), ev.event).unwrap();
        }
    }
    skipped
}

#[test]
fn deepseek_mla_stream_is_indexed() {
    // DeepSeek-V3 style: one KV-cache group of kind `mla_attention` (block size 64 in vLLM;
    // 4 here), chained stores, one eviction.
    let toks: Vec<u32> = (100..124).collect();
    let local = BlockHasher::new(4).local_hashes(&toks);
    for array in [false, true] {
        let b = |hs: &[u64], parent, t: &[u32]| {
            stored_full(
                array,
                hs,
                parent,
                t,
                4,
                "GPU",
                None,
                M::Nil,
                0,
                "mla_attention",
            )
        };
        let stream = vec![
            batch(vec![b(&[1, 2, 3], None, &toks[..12])]),
            batch(vec![b(&[4, 5, 6], Some(3), &toks[12..24])]),
            batch(vec![removed_full(array, &[6], "GPU", 0)]),
        ];
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        let w = WorkerId::new(3, 0);
        assert_eq!(feed(&index, w, cfg4(), &stream), 0, "nothing skipped");
        assert_eq!(index.find_matches(&local).get(w), 5, "array {array}");
        assert_eq!(index.find_matches(&local[..3]).get(w), 3);
        // `sink_full_attention` is indexed too; a config without MLA skips it.
        let sink = batch(vec![stored_full(
            array,
            &[9],
            None,
            &toks[..4],
            4,
            "GPU",
            None,
            M::Nil,
            0,
            "sink_full_attention",
        )]);
        assert_eq!(decode_batch(&enc(&sink), &cfg4()).unwrap().events.len(), 1);
        let only_full = cfg4().with_attention_kinds(["full_attention"]);
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        assert_eq!(feed(&index, w, only_full, &stream), 2 + 1);
        assert!(index.find_matches(&local).is_empty());
    }
}

#[test]
fn hybrid_sliding_window_and_full_attention_stream() {
    // A hybrid model (Gemma-3 / gpt-oss style): group 0 full attention, group 1 sliding
    // window, each block stored in both groups under different hashes; the window group
    // evicts old blocks early. Only group 0 is indexed.
    let toks: Vec<u32> = (1..=16).collect();
    let local = BlockHasher::new(4).local_hashes(&toks);
    for array in [false, true] {
        let full = |hs: &[u64], parent, t: &[u32]| {
            stored_full(
                array,
                hs,
                parent,
                t,
                4,
                "GPU",
                None,
                M::Nil,
                0,
                "full_attention",
            )
        };
        let window = |hs: &[u64], parent, t: &[u32]| {
            stored_full(
                array,
                hs,
                parent,
                t,
                4,
                "GPU",
                None,
                M::Nil,
                1,
                "sliding_window",
            )
        };
        let stream = vec![
            batch(vec![
                full(&[1, 2], None, &toks[..8]),
                window(&[101, 102], None, &toks[..8]),
            ]),
            batch(vec![
                window(&[103, 104], Some(102), &toks[8..]),
                full(&[3, 4], Some(2), &toks[8..]),
                // the window slides: its first blocks go (group 1, skipped)
                removed_full(array, &[101, 102], "GPU", 1),
            ]),
            // a later batch: the decoder remembers group 1 is a window group
            batch(vec![removed_full(array, &[103], "GPU", 1)]),
        ];
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        let w = WorkerId(5);
        assert_eq!(feed(&index, w, cfg4(), &stream), 4, "array {array}");
        assert_eq!(index.find_matches(&local).get(w), 4);
        assert_eq!(index.block_count(w), 4);
        assert_eq!(
            index.stats().unknown_removes,
            0,
            "window removals never reach the index"
        );
    }
}

#[test]
fn medium_selects_the_tier() {
    let toks: Vec<u32> = (1..=12).collect();
    let local = BlockHasher::new(4).local_hashes(&toks);
    for array in [false, true] {
        let st = |medium: &str| {
            stored_full(
                array,
                &[1, 2, 3],
                None,
                &toks,
                4,
                medium,
                None,
                M::Nil,
                0,
                "full_attention",
            )
        };
        let stream = vec![
            batch(vec![st("GPU"), st("CPU")]),
            // GPU evicts the last two blocks; the CPU offload keeps them
            batch(vec![removed_full(array, &[2, 3], "GPU", 0)]),
        ];
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        let w = WorkerId(9);
        feed(&index, w, cfg4(), &stream);
        let s = index.find_matches(&local);
        assert_eq!(
            (s.get(w), s.get_tier(w, Tier::Gpu), s.get_tier(w, Tier::Cpu)),
            (3, 1, 3),
            "array {array}"
        );
        let d = decode_batch(&enc(&stream[0]), &cfg4()).unwrap();
        assert_eq!(
            (d.events[0].tier(), d.events[1].tier()),
            (Tier::Gpu, Tier::Cpu)
        );
    }
}

/// The extra-keys tuple vLLM publishes for block `i` (of `bs` tokens) of a request with this
/// LoRA, salt and multimodal items (`kv_cache_utils.generate_block_hash_extra_keys`).
fn vllm_extra_keys(
    i: usize,
    bs: usize,
    lora: Option<&str>,
    salt: Option<&str>,
    mm: &[MmInput],
) -> M {
    let (start, end) = (i * bs, (i + 1) * bs);
    let mut keys = Vec::new();
    if let Some(l) = lora {
        keys.push(s(l));
    }
    for m in mm {
        if m.offset < end && start < m.offset + m.length {
            let off = m.offset as i64 - start as i64;
            keys.push(M::A(vec![
                s(m.identifier),
                if off < 0 { M::I(off) } else { u(off as u64) },
            ]));
        }
    }
    if let (0, Some(salt)) = (i, salt) {
        keys.push(s(salt));
    }
    if keys.is_empty() {
        M::Nil
    } else {
        M::A(keys)
    }
}

#[test]
fn partitions_hash_like_the_engine() {
    // One request: LoRA adapter, cache salt, an image spanning blocks 1..=3.
    let bs = 4;
    let toks: Vec<u32> = (500..520).collect(); // 5 blocks
    let image = [MmInput {
        identifier: "sha256:img",
        offset: 7,
        length: 6,
    }];
    let keys = CacheKeys {
        lora_name: Some("adapter-1"),
        cache_salt: Some("tenant-a"),
        mm_inputs: &image,
        ..CacheKeys::default()
    };
    let hasher = BlockHasher::new(bs);
    let mine = hasher.local_hashes_with(&toks, &keys);
    for array in [false, true] {
        let extra = M::A(
            (0..5)
                .map(|i| vllm_extra_keys(i, bs, Some("adapter-1"), Some("tenant-a"), &image))
                .collect(),
        );
        let ev = stored_full(
            array,
            &[11, 12, 13, 14, 15],
            None,
            &toks,
            bs as u64,
            "GPU",
            Some("adapter-1"),
            extra,
            0,
            "full_attention",
        );
        let got = decode_batch(&enc(&batch(vec![ev.clone()])), &cfg4()).unwrap();
        let (_, blocks) = stored_event(&got, 0);
        assert_eq!(local_hashes(&blocks), mine, "array {array}");

        let index = BlockIndex::with_hasher(&hasher);
        let w = WorkerId(1);
        feed(&index, w, cfg4(), &[batch(vec![ev])]);
        assert_eq!(index.find_matches(&mine).get(w), 5);
        // Another salt, another adapter, no keys at all: other partitions, nothing matches.
        for other in [
            CacheKeys {
                cache_salt: Some("tenant-b"),
                ..keys
            },
            CacheKeys {
                lora_name: Some("adapter-2"),
                ..keys
            },
            CacheKeys::default(),
        ] {
            let l = hasher.local_hashes_with(&toks, &other);
            assert_eq!(index.find_matches(&l).get(w), 0, "{other:?}");
        }
        // Same salt and adapter, another image or none: block 0 (before the image) matches.
        let other_image = [MmInput {
            identifier: "sha256:other",
            ..image[0]
        }];
        for mm in [&other_image[..], &[]] {
            let l = hasher.local_hashes_with(
                &toks,
                &CacheKeys {
                    mm_inputs: mm,
                    ..keys
                },
            );
            assert_eq!(index.find_matches(&l).get(w), 1);
        }
    }
    // Older engines: `lora_id` only, extra keys led by the id.
    let ev = M::Map(vec![
        kv("type", s("BlockStored")),
        kv("block_hashes", hashes(&[1, 2])),
        kv("parent_block_hash", M::Nil),
        kv("token_ids", tokens(&toks[..8])),
        kv("block_size", u(4)),
        kv("lora_id", u(7)),
        kv("medium", s("GPU")),
        kv("extra_keys", M::A(vec![M::A(vec![u(7)]), M::A(vec![u(7)])])),
    ]);
    let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
    let (_, blocks) = stored_event(&got, 0);
    let by_id = CacheKeys {
        lora_id: Some(7),
        ..CacheKeys::default()
    };
    assert_eq!(
        local_hashes(&blocks),
        hasher.local_hashes_with(&toks[..8], &by_id)
    );
    assert_ne!(local_hashes(&blocks), hasher.local_hashes(&toks[..8]));
    // One entry per block, unless all are nil.
    let bad = stored_full(
        false,
        &[1, 2],
        None,
        &toks[..8],
        4,
        "GPU",
        None,
        M::A(vec![M::A(vec![s("x")])]),
        0,
        "full_attention",
    );
    malformed_event(&enc(&batch(vec![bad])));
}

/// Every kind of value an engine may publish in a block's extra keys salts the block's local
/// hash, and keys that differ in kind or value only (a string and a tuple holding it, two ext
/// types, two floats) hash apart; the same keys hash the same.
#[test]
fn every_kind_of_extra_key_hashes_apart() {
    let toks: Vec<u32> = (900..904).collect();
    let plain = BlockHasher::new(4).local_hashes(&toks)[0];
    let local = |key: &[M]| {
        let ev = stored_full(
            false,
            &[1],
            None,
            &toks,
            4,
            "GPU",
            None,
            M::A(vec![M::A(key.to_vec())]),
            0,
            "full_attention",
        );
        let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
        let (_, blocks) = stored_event(&got, 0);
        assert_eq!(blocks.len(), 1);
        blocks[0].local_hash
    };
    let f32_bytes = |f: f32| [&[0xca][..], &f.to_be_bytes()].concat();
    let keys: Vec<(&str, Vec<M>)> = vec![
        ("nil", vec![M::Nil]),
        ("true", vec![M::Raw(vec![0xc3])]),
        ("false", vec![M::Raw(vec![0xc2])]),
        ("uint", vec![u(1)]),
        ("uint 2", vec![u(2)]),
        ("negative int", vec![M::I(-1)]),
        ("float 64", vec![M::F(1.5)]),
        ("float 32", vec![M::Raw(f32_bytes(2.5))]),
        ("str", vec![s("x")]),
        ("bin", vec![M::B(b"x".to_vec())]),
        ("tuple of the str", vec![M::A(vec![s("x")])]),
        ("empty tuple", vec![M::A(vec![])]),
        ("empty map", vec![M::Map(vec![])]),
        ("map", vec![M::Map(vec![(s("x"), u(1))])]),
        ("ext 1", vec![M::Raw(vec![0xd4, 1, b'x'])]),
        ("ext 2", vec![M::Raw(vec![0xd4, 2, b'x'])]),
        ("two keys", vec![s("x"), u(1)]),
    ];
    let mut seen = vec![("no keys", plain)];
    for (name, key) in &keys {
        let h = local(key);
        assert_eq!(h, local(key), "{name} hashes alike twice");
        for (other, o) in &seen {
            assert_ne!(h, *o, "{name} and {other}");
        }
        seen.push((name, h));
    }
}

#[test]
fn fuzz_seed_with_mla_tiers_and_extra_keys_decodes() {
    let payload = include_bytes!("../fuzz/corpus/kv_event_decode/mla_tiers_extra_keys.msgpack");
    let b = decode_batch(payload, &cfg4()).unwrap();
    assert_eq!((b.events.len(), b.skipped_groups), (3, 1));
    assert_eq!(b.data_parallel_rank, Some(2));
    let tiers: Vec<Tier> = b.events.iter().map(|e| e.tier()).collect();
    assert_eq!(tiers, [Tier::Cpu, Tier::Gpu, Tier::Disk]);
    let (_, blocks) = stored_event(&b, 0);
    let image = [MmInput {
        identifier: "img",
        offset: 7,
        length: 6,
    }];
    let keys = CacheKeys {
        lora_name: Some("adapter-1"),
        cache_salt: Some("tenant-a"),
        mm_inputs: &image,
        ..CacheKeys::default()
    };
    let toks: Vec<u32> = (1..13).collect();
    assert_eq!(
        local_hashes(&blocks),
        BlockHasher::new(4).local_hashes_with(&toks, &keys)
    );
}

#[test]
fn a_block_stored_twice_survives_one_removal() {
    // vLLM stores the same block hash twice when two requests compute it at once, and
    // removes it once per copy.
    let toks: Vec<u32> = (40..48).collect();
    let local = BlockHasher::new(4).local_hashes(&toks);
    for array in [false, true] {
        let st = stored_full(
            array,
            &[1, 2],
            None,
            &toks,
            4,
            "GPU",
            None,
            M::Nil,
            0,
            "full_attention",
        );
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        let w = WorkerId::new(2, 1);
        let rm = || batch(vec![removed_full(array, &[2], "GPU", 0)]);
        feed(
            &index,
            w,
            cfg4(),
            &[batch(vec![st.clone()]), batch(vec![st]), rm()],
        );
        assert_eq!(index.find_matches(&local).get(w), 2, "array {array}");
        feed(&index, w, cfg4(), &[rm()]);
        assert_eq!(index.find_matches(&local).get(w), 1);
        assert_eq!(index.stats().duplicate_copies, 2);
    }
}

/// `BlockStored` as an array with the first eight fields and then `extra` (`group_idx`, ...).
fn stored_array(block_hashes: &[u64], token_ids: &[u32], block_size: u64, medium: &str) -> M {
    M::A(vec![
        s("BlockStored"),
        hashes(block_hashes),
        M::Nil,
        tokens(token_ids),
        u(block_size),
        M::Nil,
        s(medium),
        M::Nil,
    ])
}

#[test]
fn stores_without_tokens_are_skipped() {
    // vLLM's offloading connector (`OffloadingConnectorScheduler.take_events`) publishes its
    // CPU-tier stores as placeholders: `token_ids = []`, `parent_block_hash = None`,
    // `block_size` 0 (or, in older releases, the block size). The scheduler sends them in the
    // same batch as the GPU events, which must still apply.
    let local = BlockHasher::new(4).local_hashes(&TOKENS);
    for block_size in [0, 4] {
        for array in [false, true] {
            let gpu = if array {
                stored_array(&[H1, H2], &TOKENS, 4, "GPU")
            } else {
                stored_full(
                    false,
                    &[H1, H2],
                    None,
                    &TOKENS,
                    4,
                    "GPU",
                    None,
                    M::Nil,
                    0,
                    "full_attention",
                )
            };
            let payload = enc(&batch(vec![
                gpu,
                stored_array(&[H1, H2], &[], block_size, "CPU"),
                removed_full(array, &[H2], "CPU", 0),
            ]));
            let got = decode_batch(&payload, &cfg4())
                .unwrap_or_else(|e| panic!("block_size {block_size}, array {array}: {e}"));
            assert_eq!(got.events.len(), 2);
            assert_eq!(got.skipped_groups, 1);
            assert_eq!(got.events[1].tier(), Tier::Cpu);
            let index = BlockIndex::with_hasher(&BlockHasher::new(4));
            let w = WorkerId(1);
            for ev in got.events {
                index.apply_in(w, ev.tier(), ev.event).unwrap();
            }
            let m = index.find_matches(&local);
            assert_eq!((m.get_tier(w, Tier::Gpu), m.get_tier(w, Tier::Cpu)), (2, 0));
        }
    }
}

#[test]
fn stores_that_skip_null_blocks_are_skipped() {
    // vLLM's `BlockPool.cache_full_blocks` leaves null blocks (sliding window, Mamba in align
    // mode) out of `block_hashes` but not out of `token_ids`. Releases that send `group_idx`
    // without `kv_cache_spec_kind` give no other sign of such a group (Mamba hybrids:
    // Qwen3-Next, Nemotron-H). Such a store is skipped and the rest of its batch applies; the
    // group stays indexed, so that the copies its earlier, dense stores made are taken away by
    // its removals (every group publishes the same block hashes).
    let toks: Vec<u32> = (1..=16).collect();
    let local = BlockHasher::new(4).local_hashes(&toks);
    let with_group = |ev: M, g: u64| match ev {
        M::A(mut v) => {
            v.extend([M::Nil, u(g)]);
            M::A(v)
        }
        other => other,
    };
    let with_parent = |ev: M, parent: u64| match ev {
        M::A(mut v) => {
            v[2] = u(parent);
            M::A(v)
        }
        other => other,
    };
    let removed = |h: &[u64], g: u64| removed_full(true, h, "GPU", g);
    let run = |stream: &[M]| -> (usize, usize) {
        let mut dec = Decoder::new(cfg4()).unwrap();
        let index = BlockIndex::with_hasher(&BlockHasher::new(4));
        let w = WorkerId(8);
        let mut skipped = 0;
        for b in stream {
            let got = dec.decode(&enc(b)).unwrap();
            skipped += got.skipped_groups;
            for ev in got.events {
                index.apply_in(w, ev.tier(), ev.event).unwrap();
            }
        }
        (skipped, index.find_matches(&local).get(w))
    };
    // A sparse store beside the attention group's: skipped, the attention group's applies.
    let sparse_beside_dense = batch(vec![
        with_group(stored_array(&[1, 2, 3, 4], &toks, 4, "GPU"), 0),
        // group 1 (Mamba): only the last block is kept
        with_group(stored_array(&[4], &toks, 4, "GPU"), 1),
    ]);
    assert_eq!(run(std::slice::from_ref(&sparse_beside_dense)), (1, 4));
    // Stateless, one batch: the same.
    let got = decode_batch(&enc(&sparse_beside_dense), &cfg4()).unwrap();
    assert_eq!((got.events.len(), got.skipped_groups), (1, 1));
    // The Mamba group's first store is dense (a short prompt has no null block), its next one
    // sparse; then both groups remove their blocks. Nothing stays behind (a group marked as
    // sparse at its sparse store kept the copy of its dense store until `Cleared`).
    let stream = [
        batch(vec![
            with_group(stored_array(&[1], &toks[..4], 4, "GPU"), 0),
            with_group(stored_array(&[1], &toks[..4], 4, "GPU"), 1),
        ]),
        batch(vec![
            with_group(
                with_parent(stored_array(&[2, 3], &toks[4..12], 4, "GPU"), 1),
                0,
            ),
            with_group(
                with_parent(stored_array(&[3], &toks[4..12], 4, "GPU"), 1),
                1,
            ),
        ]),
        batch(vec![removed(&[1, 2, 3], 0), removed(&[1], 1)]),
    ];
    assert_eq!(run(&stream), (1, 0));
}

#[test]
fn a_smaller_store_does_not_shrink_the_expansion_of_later_removals() {
    // A newer vLLM also publishes partial entries (`cache_partial_block`) whose `block_size`
    // is smaller than the engine's blocks. A removal of a full engine block that follows one
    // must still remove all of its router blocks (it used to take k from the last store, and
    // left the synthetic sub-blocks of the full block indexed).
    let toks = tokens64();
    let stream = [
        batch(vec![stored_map(
            hashes(&[11]),
            M::Nil,
            &toks[..32],
            32,
            M::Nil,
            0,
            "full_attention",
        )]),
        batch(vec![stored_map(
            hashes(&[22]),
            u(11),
            &toks[32..48],
            16,
            M::Nil,
            0,
            "full_attention",
        )]),
        batch(vec![
            removed_map(hashes(&[22]), 0),
            removed_map(hashes(&[11]), 0),
        ]),
    ];
    let mut dec = Decoder::new(DecodeConfig::new(16)).unwrap();
    let index = BlockIndex::with_hasher(&BlockHasher::new(16));
    let w = WorkerId(3);
    let local = BlockHasher::new(16).local_hashes(&toks[..48]);
    for (i, b) in stream.iter().enumerate() {
        for ev in dec.decode(&enc(b)).unwrap().events {
            index.apply_in(w, ev.tier(), ev.event).unwrap();
        }
        if i == 1 {
            assert_eq!(index.find_matches(&local).get(w), 3);
        }
    }
    assert_eq!(index.find_matches(&local).get(w), 0);
}

#[test]
fn split_engine_blocks_key_their_sub_blocks_like_the_request() {
    // Engine blocks of 8 tokens, router blocks of 4: the salt belongs to router block 0 only,
    // and an image to the sub-blocks it reaches, with offsets from each sub-block's start.
    let toks: Vec<u32> = (700..724).collect(); // 3 engine blocks, 6 router blocks
    let image = [MmInput {
        identifier: "sha256:img",
        offset: 6,
        length: 12, // router blocks 1..=4: it ends inside engine block 2, after its first half
    }];
    let hasher = BlockHasher::new(4);
    for (salt, mm, exact) in [
        (Some("tenant-a"), &[][..], 6),
        (None, &image[..], 5),
        (Some("tenant-a"), &image[..], 5),
    ] {
        let keys = CacheKeys {
            cache_salt: salt,
            mm_inputs: mm,
            ..CacheKeys::default()
        };
        let mine = hasher.local_hashes_with(&toks, &keys);
        for array in [false, true] {
            let extra = M::A(
                (0..3)
                    .map(|i| vllm_extra_keys(i, 8, None, salt, mm))
                    .collect(),
            );
            let ev = stored_full(
                array,
                &[21, 22, 23],
                None,
                &toks,
                8,
                "GPU",
                None,
                extra,
                0,
                "full_attention",
            );
            let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
            let (_, blocks) = stored_event(&got, 0);
            let theirs = local_hashes(&blocks);
            // The item's length is not published: it is taken to reach the end of its last
            // engine block, so the sub-block after its end (router block 5) differs.
            let same = mine.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
            assert_eq!(
                same,
                exact,
                "salt {salt:?}, image {}, array {array}",
                mm.len()
            );
        }
    }
}

/// SGLang's array-encoded `BlockStored` (`disaggregation/kv_events.py`): vLLM's first six
/// fields, then for salted requests (`BlockStoredWithMetadata`) a `metadata` map.
fn sglang_stored(block_hashes: &[u64], parent: Option<u64>, toks: M, salt: Option<&str>) -> M {
    let mut ev = vec![
        s("BlockStored"),
        hashes(block_hashes),
        parent.map_or(M::Nil, u),
        toks,
        u(4),
        M::Nil,
        s("GPU"),
    ];
    if let Some(salt) = salt {
        ev.push(M::Map(vec![kv("cache_salt", s(salt))]));
    }
    M::A(ev)
}

#[test]
fn sglang_salted_stores_hash_like_a_salted_request() {
    let toks: Vec<u32> = (900..916).collect(); // 4 blocks
    let hasher = BlockHasher::new(4);
    let salted = CacheKeys {
        cache_salt: Some("tenant-a"),
        ..CacheKeys::default()
    };
    let mine = hasher.local_hashes_with(&toks, &salted);
    let plain = hasher.local_hashes(&toks);
    // Two stores of one salted request (the second chains from the first) and a removal of
    // an unrelated block, in one batch: all of it applies.
    let first = sglang_stored(&[1, 2], None, tokens(&toks[..8]), Some("tenant-a"));
    let second = sglang_stored(&[3, 4], Some(2), tokens(&toks[8..]), Some("tenant-a"));
    let removal = M::A(vec![s("BlockRemoved"), hashes(&[99]), s("GPU")]);
    let b = M::A(vec![M::F(1.0), M::A(vec![first, second, removal]), u(3)]);
    let got = decode_batch(&enc(&b), &cfg4()).unwrap();
    assert_eq!((got.events.len(), got.data_parallel_rank), (3, Some(3)));
    let (_, a) = stored_event(&got, 0);
    let (parent, b2) = stored_event(&got, 1);
    assert_eq!(parent, Some(2));
    // The salt is in block 0 only; later blocks inherit it through the chain.
    assert_eq!([local_hashes(&a), local_hashes(&b2)].concat(), mine);
    assert_ne!(mine[0], plain[0]);
    assert_eq!(mine[1..], plain[1..]);
    // Map-encoded events carry it as a top-level `cache_salt` (or in `metadata`).
    for salt_field in [
        kv("cache_salt", s("tenant-a")),
        kv(
            "metadata",
            M::Map(vec![
                kv("cache_salt", s("tenant-a")),
                kv("session_id", s("x")),
            ]),
        ),
    ] {
        let ev = M::Map(vec![
            kv("type", s("BlockStored")),
            kv("block_hashes", hashes(&[1, 2])),
            kv("parent_block_hash", M::Nil),
            kv("token_ids", tokens(&toks[..8])),
            kv("block_size", u(4)),
            kv("lora_id", M::Nil),
            kv("medium", s("GPU")),
            salt_field,
        ]);
        let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
        assert_eq!(local_hashes(&stored_event(&got, 0).1), mine[..2]);
    }
    // An index fed these stores matches the salted request, not an unsalted one.
    let index = BlockIndex::with_hasher(&hasher);
    let w = WorkerId(5);
    let first = sglang_stored(&[1, 2], None, tokens(&toks[..8]), Some("tenant-a"));
    let second = sglang_stored(&[3, 4], Some(2), tokens(&toks[8..]), Some("tenant-a"));
    feed(&index, w, cfg4(), &[batch(vec![first, second])]);
    assert_eq!(index.find_matches(&mine).get(w), 4);
    assert_eq!(index.find_matches(&plain).get(w), 0);
    // A metadata map of the wrong shape is an error, not a misread.
    let bad = M::A(vec![
        s("BlockStored"),
        hashes(&[1]),
        M::Nil,
        tokens(&toks[..4]),
        u(4),
        M::Nil,
        s("GPU"),
        M::Map(vec![kv("cache_salt", u(7))]),
    ]);
    malformed_event(&enc(&batch(vec![bad])));
    // Under these names, values of other kinds are other publishers' fields: ignored, as
    // unknown keys are (the store hashes unsalted).
    for (key, value) in [
        ("cache_salt", u(5)),
        ("metadata", s("x")),
        ("metadata", M::A(vec![u(1)])),
    ] {
        let ev = M::Map(vec![
            kv("type", s("BlockStored")),
            kv("block_hashes", hashes(&[1, 2])),
            kv("parent_block_hash", M::Nil),
            kv("token_ids", tokens(&toks[..8])),
            kv("block_size", u(4)),
            kv(key, value.clone()),
        ]);
        let removal = M::Map(vec![
            kv("type", s("BlockRemoved")),
            kv("block_hashes", hashes(&[1])),
            kv(key, value),
        ]);
        let got = decode_batch(&enc(&batch(vec![ev, removal])), &cfg4()).unwrap();
        assert_eq!(local_hashes(&stored_event(&got, 0).1), plain[..2], "{key}");
        assert_eq!(got.events.len(), 2);
    }
}

#[test]
fn a_salt_equal_to_the_lora_name_is_still_hashed() {
    // The LoRA name leads each block's `extra_keys` and goes into the seed; a salt that equals
    // it is a key of its own.
    let toks: Vec<u32> = (100..108).collect();
    let ev = M::Map(vec![
        kv("type", s("BlockStored")),
        kv("block_hashes", hashes(&[1, 2])),
        kv("parent_block_hash", M::Nil),
        kv("token_ids", tokens(&toks)),
        kv("block_size", u(4)),
        kv("lora_name", s("x")),
        kv(
            "extra_keys",
            M::A(vec![M::A(vec![s("x")]), M::A(vec![s("x")])]),
        ),
        kv("cache_salt", s("x")),
    ]);
    let got = decode_batch(&enc(&batch(vec![ev])), &cfg4()).unwrap();
    let keys = CacheKeys {
        lora_name: Some("x"),
        cache_salt: Some("x"),
        ..CacheKeys::default()
    };
    assert_eq!(
        local_hashes(&stored_event(&got, 0).1),
        BlockHasher::new(4).local_hashes_with(&toks, &keys)
    );
}

#[test]
fn sglang_bigram_token_ids_hash_as_their_tokens() {
    // EAGLE speculative decoding: SGLang's radix keys are bigrams `(t[i], t[i + 1])`.
    let toks: Vec<u32> = (300..308).collect();
    let pairs = M::A(
        toks.iter()
            .map(|&t| M::A(vec![u(u64::from(t)), u(u64::from(t) + 1)]))
            .collect(),
    );
    let b = batch(vec![
        sglang_stored(&[1, 2], None, pairs, None),
        M::A(vec![s("BlockRemoved"), hashes(&[1]), s("GPU")]),
    ]);
    let got = decode_batch(&enc(&b), &cfg4()).unwrap();
    assert_eq!(got.events.len(), 2);
    assert_eq!(
        local_hashes(&stored_event(&got, 0).1),
        BlockHasher::new(4).local_hashes(&toks)
    );
    // An empty pair is not a token.
    let empty = sglang_stored(&[1], None, M::A(vec![M::A(vec![]); 4]), None);
    malformed_event(&enc(&batch(vec![empty])));
}

#[test]
fn shared_pool_tiers_are_skipped_as_remote() {
    // SGLang's EXTERNAL tier is a pool shared by engines (Mooncake, say), not this worker's.
    let toks: Vec<u32> = (10..18).collect();
    for medium in ["EXTERNAL", "remote", "Shared"] {
        for array in [false, true] {
            let b = batch(vec![
                stored_full(
                    array,
                    &[1, 2],
                    None,
                    &toks,
                    4,
                    medium,
                    None,
                    M::Nil,
                    0,
                    "full_attention",
                ),
                removed_full(array, &[1], medium, 0),
                stored_full(
                    array,
                    &[1, 2],
                    None,
                    &toks,
                    4,
                    "CPU_PINNED",
                    None,
                    M::Nil,
                    0,
                    "full_attention",
                ),
            ]);
            let got = decode_batch(&enc(&b), &cfg4()).unwrap();
            assert_eq!((got.events.len(), got.skipped_remote), (1, 2), "{medium}");
            assert_eq!(got.events[0].tier(), Tier::Cpu);
        }
    }
}

#[test]
fn sglang_seed_encoded_by_msgspec_decodes() {
    // Encoded by msgspec from SGLang's own classes (`BlockStoredWithMetadata`, a bigram store
    // chained to it, a store and removal in the shared EXTERNAL tier, a GPU removal).
    let payload =
        include_bytes!("../fuzz/corpus/kv_event_decode/sglang_salted_bigram_external.msgpack");
    let b = decode_batch(payload, &cfg4()).unwrap();
    assert_eq!((b.events.len(), b.skipped_remote), (3, 2));
    assert_eq!(b.data_parallel_rank, Some(1));
    let toks: Vec<u32> = (1..13).collect();
    let salted = CacheKeys {
        cache_salt: Some("tenant-a"),
        ..CacheKeys::default()
    };
    let (_, first) = stored_event(&b, 0);
    let (parent, second) = stored_event(&b, 1);
    assert_eq!(parent, Some(12));
    assert_eq!(
        [local_hashes(&first), local_hashes(&second)].concat(),
        BlockHasher::new(4).local_hashes_with(&toks, &salted)
    );
}
