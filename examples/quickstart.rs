//! Builds a small tree from a few prompts and prints what each replica holds.
//!
//! `cargo run --release --example quickstart`

use kvtrie::PrefixTree;

fn main() {
    let tree = PrefixTree::new();
    let replicas: Vec<_> = ["replica-a", "replica-b", "replica-c"]
        .iter()
        .map(|r| tree.add_tenant(r))
        .collect();
    let system = "You are a helpful assistant. Answer concisely.\n";
    let prompts = [
        "What is a radix tree?",
        "What is a KV cache?",
        "Explique le cache KV en français.",
        "用中文解释一下前缀缓存。",
    ];
    for (i, p) in prompts.iter().enumerate() {
        let text = format!("{system}{p}");
        let r = replicas[i % replicas.len()];
        tree.insert(&text, r).unwrap();
    }
    for q in [
        format!("{system}What is a radix tree? And a trie?"),
        format!("{system}用中文解释一下KV缓存。"),
        "Unrelated prompt".to_string(),
    ] {
        let m = tree.prefix_match(&q, None);
        let owners: Vec<_> = m
            .tenants
            .iter()
            .map(|t| tree.tenant_name(t).unwrap().to_string())
            .collect();
        println!(
            "{:>3} of {:>3} chars matched, held by {:?}",
            m.matched_chars,
            q.chars().count(),
            owners
        );
    }
    for &r in &replicas {
        println!(
            "{}: {} chars",
            tree.tenant_name(r).unwrap(),
            tree.char_count(r).unwrap()
        );
    }
    let s = tree.stats();
    println!(
        "{} nodes, {} distinct chars, {} heap bytes",
        s.nodes, s.chars, s.heap_bytes
    );
}
