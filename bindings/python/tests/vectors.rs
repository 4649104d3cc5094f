//! The reference vectors the Python suite checks the module against
//! (`tests/data/vectors.json`): block hashes (local, sequence, salted) and a fingerprint of
//! workload W1, computed here by the Rust crate. This test fails if the file and the crate
//! disagree; `KVTRIE_BLESS=1 cargo test -p kvtrie-python --test vectors` rewrites it.

use kvtrie::workload::ChatWorkload;
use kvtrie::BlockHasher;

fn list<T: std::fmt::Display>(xs: &[T]) -> String {
    let items: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

fn quoted(s: &str) -> String {
    // W1 text is ASCII letters only: no escaping needed.
    assert!(s.bytes().all(|b| b.is_ascii_alphanumeric()));
    format!("\"{s}\"")
}

fn hash_case(h: &BlockHasher, salt: Option<(&str, &str)>, tokens: &[u32]) -> String {
    let salt_json = match salt {
        None => "null".to_string(),
        Some((l, n)) => format!("[\"{l}\", \"{n}\"]"),
    };
    format!(
        "    {{\"block_size\": {}, \"salt\": {}, \"seed\": {}, \"tokens\": {}, \"local\": {}, \
         \"sequence\": {}}}",
        h.block_size(),
        salt_json,
        h.seed(),
        list(tokens),
        list(&h.local_hashes(tokens)),
        list(&h.sequence_hashes(tokens)),
    )
}

fn expected() -> String {
    let counting: Vec<u32> = (0..40).collect();
    let extremes: Vec<u32> = vec![0, 1, 31_999, 1 << 31, u32::MAX, 7, 7, 7];
    let vllm: Vec<u32> = (1..=8).collect();
    let mut cases = Vec::new();
    for bs in [1usize, 4, 16] {
        let h = BlockHasher::new(bs);
        cases.push(hash_case(&h, None, &counting));
        cases.push(hash_case(&h, None, &extremes));
        let salted = h.with_salt("my-lora", "ns");
        cases.push(hash_case(&salted, Some(("my-lora", "ns")), &counting));
    }
    cases.push(hash_case(&BlockHasher::new(4), None, &vllm));

    let w1 = ChatWorkload::w1(1000);
    let total: usize = w1.prompts.iter().map(|p| p.len()).sum();
    let lens: Vec<usize> = w1.prompts.iter().take(5).map(|p| p.len()).collect();
    let qsys: Vec<usize> = w1.query_system.iter().take(10).copied().collect();
    let tail = |s: &str| s[s.len() - 40..].to_string();
    format!(
        "{{\n  \"hashing\": [\n{}\n  ],\n  \"w1\": {{\n    \"queries\": 1000,\n    \
         \"system0_head\": {},\n    \"prompt_lengths_first5\": {},\n    \
         \"total_prompt_chars\": {},\n    \"prompt9999_tail\": {},\n    \
         \"query_system_first10\": {},\n    \"query999_tail\": {}\n  }}\n}}\n",
        cases.join(",\n"),
        quoted(&w1.system[0][..40]),
        list(&lens),
        total,
        quoted(&tail(&w1.prompts[9999])),
        list(&qsys),
        quoted(&tail(&w1.queries[999])),
    )
}

#[test]
fn vectors_file_matches_the_rust_crate() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/vectors.json");
    let want = expected();
    if std::env::var_os("KVTRIE_BLESS").is_some() {
        std::fs::write(path, &want).expect("write tests/data/vectors.json");
    }
    let have = std::fs::read_to_string(path).expect("read tests/data/vectors.json");
    assert_eq!(
        have, want,
        "tests/data/vectors.json is stale (KVTRIE_BLESS=1 rewrites it)"
    );
}
