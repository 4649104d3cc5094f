//! Every rule of DESIGN.md's "PrefixTree semantics", with exact expected values.
#![cfg(not(loom))]

use kvtrie::{Error, NodeSnapshot, PrefixTree, TenantId, TenantSet, MAX_TEXT_BYTES};

fn ids(m: &kvtrie::PrefixMatch) -> Vec<TenantId> {
    m.tenants.iter().collect()
}

fn node(text: &str, tenants: Vec<(TenantId, u64)>, children: Vec<NodeSnapshot>) -> NodeSnapshot {
    NodeSnapshot {
        text: text.into(),
        tenants,
        children,
    }
}

fn check(tree: &PrefixTree) {
    tree.check_invariants().unwrap();
}

#[test]
fn design_example() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("replica-a");
    let b = tree.add_tenant("replica-b");
    tree.insert_at("hello world", a, 1).unwrap();
    tree.insert_at("hello there", b, 2).unwrap();
    let m = tree.prefix_match("hello wor", None);
    assert_eq!((m.matched_chars, ids(&m)), (9, vec![a]));
    assert_eq!(m.matched_bytes, 9);
    assert_eq!(tree.char_count(a), Some(11));
    assert_eq!(tree.char_count(b), Some(11));
    assert_eq!(
        tree.snapshot(),
        node(
            "",
            vec![(a, 1), (b, 2)],
            vec![node(
                "hello ",
                vec![(a, 1), (b, 2)],
                vec![
                    node("there", vec![(b, 2)], vec![]),
                    node("world", vec![(a, 1)], vec![]),
                ]
            )]
        )
    );
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 11);
    assert_eq!(tree.char_count(a), Some(0));
    assert_eq!(tree.char_count(b), Some(11));
    assert_eq!(
        tree.snapshot(),
        node(
            "",
            vec![(a, 1), (b, 2)],
            vec![node(
                "hello ",
                vec![(b, 2)],
                vec![node("there", vec![(b, 2)], vec![])]
            )]
        )
    );
    assert_eq!(tree.node_count(), 2);
    check(&tree);
}

#[test]
fn add_tenant_is_idempotent_and_names_map_both_ways() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("xyz", a, 3).unwrap();
    assert_eq!(tree.add_tenant("a"), a);
    assert_eq!(tree.char_count(a), Some(3));
    assert_eq!(tree.tenant_id("a"), Some(a));
    assert_eq!(tree.tenant_id("nope"), None);
    assert_eq!(&*tree.tenant_name(a).unwrap(), "a");
    let b = tree.add_tenant("b");
    assert_ne!(a, b);
    assert_eq!(tree.tenants(), vec![a, b]);
}

#[test]
fn tenants_added_in_a_batch_are_tenants_like_any_other() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("shared prefix", a, 1).unwrap();
    // New names, a repeated one, an existing one; slots of removed tenants are reused.
    let gone = tree.add_tenant("gone");
    tree.remove_tenant(gone);
    let names: Vec<String> = (0..300).map(|i| format!("r{i}")).collect();
    let mut batch: Vec<&str> = names.iter().map(String::as_str).collect();
    batch.extend(["a", "r7"]);
    let got: Vec<TenantId> = tree
        .try_add_tenants(&batch)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!((got[300], got[301]), (a, got[7]));
    let mut all = got[..300].to_vec();
    all.push(a);
    all.sort();
    assert_eq!(tree.tenants(), all);
    for (name, &t) in names.iter().zip(&got) {
        assert_eq!(tree.tenant_id(name), Some(t));
        assert_eq!(tree.char_count(t), Some(0));
    }
    // Each new tenant can insert, match and be matched at once; `a` kept its tree.
    tree.insert_at("shared prefix and more", got[299], 2)
        .unwrap();
    let m = tree.prefix_match("shared prefix and more", None);
    assert_eq!((m.matched_chars, ids(&m)), (22, vec![got[299]]));
    assert_eq!(tree.char_count(a), Some(13));
    check(&tree);
    assert!(tree.try_add_tenants(&[]).is_empty());
}

#[test]
fn partial_match_inside_a_node_counts() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("hello", a, 1).unwrap();
    let m = tree.prefix_match("help", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (3, 3, vec![a]));
    assert_eq!(tree.prefix_match("hello world", None).matched_chars, 5);
    assert_eq!(tree.prefix_match("hello", None).matched_chars, 5);
    assert_eq!(tree.prefix_match("h", None).matched_chars, 1);
    // Read-only: nothing changed.
    assert_eq!(tree.node_count(), 1);
    assert_eq!(tree.char_count(a), Some(5));
}

#[test]
fn no_match_returns_all_available_tenants_at_the_root() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("abc", a, 1).unwrap();
    let m = tree.prefix_match("zzz", None);
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![a, b]));
    let m = tree.prefix_match("", None);
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![a, b]));
    let m = tree.prefix_match("zzz", Some(&[b]));
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![b]));
    // Some(&[]) means "no tenants" (a deliberate deviation from Ray).
    let m = tree.prefix_match("abc", Some(&[]));
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![]));
}

#[test]
fn match_stops_before_an_edge_no_available_tenant_owns() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("abcdef", a, 1).unwrap();
    tree.insert_at("abcxyz", b, 2).unwrap();
    let m = tree.prefix_match("abcdef", Some(&[b]));
    assert_eq!((m.matched_chars, ids(&m)), (3, vec![b]));
    let m = tree.prefix_match("abcdef", Some(&[a]));
    assert_eq!((m.matched_chars, ids(&m)), (6, vec![a]));
    let m = tree.prefix_match("abcdef", None);
    assert_eq!((m.matched_chars, ids(&m)), (6, vec![a]));
    let m = tree.prefix_match("abcd", Some(&[a, b]));
    assert_eq!((m.matched_chars, ids(&m)), (4, vec![a]));
    let m = tree.prefix_match("abq", None);
    assert_eq!((m.matched_chars, ids(&m)), (2, vec![a, b]));
}

#[test]
fn unknown_ids_in_available_are_ignored() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let gone = tree.add_tenant("gone");
    tree.insert_at("abc", a, 1).unwrap();
    tree.insert_at("abd", gone, 1).unwrap();
    assert_eq!(tree.remove_tenant(gone), 3);
    let m = tree.prefix_match("abd", Some(&[gone]));
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![]));
    let m = tree.prefix_match("abd", Some(&[gone, a]));
    assert_eq!((m.matched_chars, ids(&m)), (2, vec![a]));
}

/// An id from another tree is unknown here (DESIGN: "Unknown/removed tenant: no change at
/// all, reported as an error value"), even where that tree has a tenant on the same slot: it
/// used to be charged to whichever tenant held the slot.
#[test]
fn ids_of_another_tree_are_unknown() {
    let (one, two) = (PrefixTree::new(), PrefixTree::new());
    let x1 = one.add_tenant("x");
    let a1 = one.add_tenant("a");
    let p2 = two.add_tenant("p");
    let q2 = two.add_tenant("q");
    assert_eq!((a1.slot(), x1.slot()), (q2.slot(), p2.slot()));
    assert_ne!(a1, q2);
    assert_eq!(
        two.insert_at("foreign", a1, 1),
        Err(Error::UnknownTenant(a1))
    );
    assert_eq!(two.char_count(q2), Some(0));
    assert_eq!(two.char_count(a1), None);
    assert_eq!(two.evict_tenant_by_lru(a1, 10), 0);
    assert_eq!(two.remove_tenant(a1), 0);
    assert!(two.tenant_name(a1).is_none());
    two.insert_at("mine", q2, 1).unwrap();
    let m = two.prefix_match("mine", Some(&[a1]));
    assert_eq!((m.matched_chars, ids(&m)), (0, vec![]));
    assert_eq!(two.char_count(q2), Some(4));
    check(&two);
}

#[test]
fn split_keeps_owners_and_times_and_counts() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("hello", a, 1).unwrap();
    tree.insert_at("help", b, 2).unwrap();
    assert_eq!(tree.char_count(a), Some(5));
    assert_eq!(tree.char_count(b), Some(4));
    assert_eq!(
        tree.snapshot().children,
        vec![node(
            "hel",
            vec![(a, 1), (b, 2)],
            vec![
                node("lo", vec![(a, 1)], vec![]),
                node("p", vec![(b, 2)], vec![])
            ]
        )]
    );
    assert_eq!(tree.node_count(), 3);
    assert_eq!(tree.distinct_chars(), 6);
    check(&tree);
}

#[test]
fn insert_ending_inside_a_node_splits_it() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("hello", a, 1).unwrap();
    tree.insert_at("hel", a, 5).unwrap();
    assert_eq!(tree.char_count(a), Some(5));
    assert_eq!(
        tree.snapshot().children,
        vec![node(
            "hel",
            vec![(a, 5)],
            vec![node("lo", vec![(a, 1)], vec![])]
        )]
    );
    // The oldest group is "lo" alone.
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 2);
    assert_eq!(tree.char_count(a), Some(3));
    assert_eq!(
        tree.snapshot().children,
        vec![node("hel", vec![(a, 5)], vec![])]
    );
    check(&tree);
}

#[test]
fn timestamps_are_monotone() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("abc", a, 5).unwrap();
    tree.insert_at("abc", a, 3).unwrap();
    assert_eq!(
        tree.snapshot().children,
        vec![node("abc", vec![(a, 5)], vec![])]
    );
    assert_eq!(tree.snapshot().tenants, vec![(a, 5)]);
    tree.insert_at("abc", a, 9).unwrap();
    assert_eq!(
        tree.snapshot().children,
        vec![node("abc", vec![(a, 9)], vec![])]
    );
}

#[test]
fn reinsert_charges_once() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    for ts in 0..5 {
        tree.insert_at("same text", a, ts).unwrap();
    }
    assert_eq!(tree.char_count(a), Some(9));
    assert_eq!(tree.node_count(), 1);
}

#[test]
fn empty_insert_touches_nothing() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("", a, 7).unwrap();
    assert_eq!(tree.snapshot(), node("", vec![(a, 0)], vec![]));
    assert_eq!(tree.char_count(a), Some(0));
}

#[test]
fn eviction_takes_whole_timestamp_groups_across_branches() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("xab", a, 1).unwrap();
    tree.insert_at("yac", a, 1).unwrap();
    tree.insert_at("zad", a, 2).unwrap();
    assert_eq!(tree.char_count(a), Some(9));
    // Group ts 1 spans two branches: 6 chars although 1 was asked (overshoot, as in Ray).
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 6);
    assert_eq!(tree.char_count(a), Some(3));
    assert_eq!(
        tree.snapshot().children,
        vec![node("zad", vec![(a, 2)], vec![])]
    );
    assert_eq!(tree.node_count(), 1);
    check(&tree);
}

#[test]
fn eviction_group_includes_parents_leaves_first() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("ab", a, 1).unwrap();
    tree.insert_at("ac", a, 1).unwrap();
    tree.insert_at("ad", a, 2).unwrap();
    // "a"{2} -> "b"{1}, "c"{1}, "d"{2}
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 2);
    assert_eq!(
        tree.snapshot().children,
        vec![node(
            "a",
            vec![(a, 2)],
            vec![node("d", vec![(a, 2)], vec![])]
        )]
    );
    // Next group (ts 2) is "d" and its parent "a".
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 2);
    assert_eq!(tree.node_count(), 0);
    assert_eq!(tree.char_count(a), Some(0));
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 0);
    check(&tree);
}

#[test]
fn eviction_continues_over_groups_until_enough() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("aaaa", a, 1).unwrap();
    tree.insert_at("bbbb", a, 2).unwrap();
    tree.insert_at("cccc", a, 3).unwrap();
    assert_eq!(tree.evict_tenant_by_lru(a, 5), 8);
    assert_eq!(
        tree.snapshot().children,
        vec![node("cccc", vec![(a, 3)], vec![])]
    );
    assert_eq!(tree.evict_tenant_by_lru(a, 100), 4);
    check(&tree);
}

/// A leaf whose time a later insert raised is evicted in the group of its new time, not lost
/// from the LRU: whichever of two leaves of one time is raised (the other goes first), the
/// second eviction takes it.
#[test]
fn a_leaf_touched_again_is_evicted_at_its_new_time() {
    for raised in ["hello", "world"] {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        tree.insert_at("hello", a, 1).unwrap();
        tree.insert_at("world", a, 1).unwrap();
        tree.insert_at(raised, a, 3).unwrap();
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 5, "{raised}");
        assert_eq!(
            tree.snapshot().children,
            vec![node(raised, vec![(a, 3)], vec![])]
        );
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 5, "{raised}");
        assert_eq!((tree.node_count(), tree.char_count(a)), (0, Some(0)));
        check(&tree);
    }
}

/// A node that becomes a leaf again and again piles up LRU entries (each time its last child
/// is evicted while its own time is newer). The heap is then compacted, and the compaction
/// keeps every current leaf: each round's new leaf is still the next group.
#[test]
fn stale_lru_entries_are_compacted_without_losing_leaves() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("prefix", a, 1_000).unwrap();
    for i in 0..200u64 {
        tree.insert_at(&format!("prefix{i:03}"), a, i + 1).unwrap();
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 3, "round {i}");
        assert_eq!(
            tree.snapshot().children,
            vec![node("prefix", vec![(a, 1_000)], vec![])]
        );
    }
    tree.insert_at("prefix!", a, 500).unwrap();
    assert_eq!(tree.evict_tenant_by_lru(a, usize::MAX), 7);
    assert_eq!((tree.node_count(), tree.char_count(a)), (0, Some(0)));
    check(&tree);
}

#[test]
fn eviction_keeps_nodes_other_tenants_own() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("shared", a, 1).unwrap();
    tree.insert_at("shared", b, 5).unwrap();
    assert_eq!(tree.evict_tenant_by_lru(a, 1), 6);
    assert_eq!(
        tree.snapshot().children,
        vec![node("shared", vec![(b, 5)], vec![])]
    );
    assert_eq!(tree.char_count(b), Some(6));
    check(&tree);
}

#[test]
fn evict_zero_or_unknown_is_a_noop() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("abc", a, 1).unwrap();
    assert_eq!(tree.evict_tenant_by_lru(a, 0), 0);
    let other = PrefixTree::new();
    let stranger = other.add_tenant("x");
    let stranger2 = other.add_tenant("y");
    let _ = stranger;
    assert_eq!(tree.evict_tenant_by_lru(stranger2, 10), 0);
    assert_eq!(tree.char_count(a), Some(3));
}

#[test]
fn remove_tenant_prunes_and_reports_once() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("hello", a, 1).unwrap();
    tree.insert_at("help", b, 2).unwrap();
    assert_eq!(tree.remove_tenant(a), 5);
    assert_eq!(tree.remove_tenant(a), 0);
    assert_eq!(tree.char_count(a), None);
    assert_eq!(tree.char_count(b), Some(4));
    assert_eq!(
        tree.snapshot(),
        node(
            "",
            vec![(b, 2)],
            vec![node(
                "hel",
                vec![(b, 2)],
                vec![node("p", vec![(b, 2)], vec![])]
            )]
        )
    );
    assert_eq!(tree.tenants(), vec![b]);
    assert_eq!(tree.tenant_id("a"), None);
    assert_eq!(tree.tenant_name(a), None);
    check(&tree);
    assert_eq!(tree.remove_tenant(b), 4);
    assert_eq!(tree.node_count(), 0);
    assert_eq!(tree.distinct_chars(), 0);
    check(&tree);
}

#[test]
fn removed_tenant_is_rejected_and_changes_nothing() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("abc", b, 1).unwrap();
    tree.remove_tenant(a);
    let before = tree.snapshot();
    assert_eq!(tree.insert_at("abd", a, 2), Err(Error::UnknownTenant(a)));
    assert_eq!(tree.insert("abd", a), Err(Error::UnknownTenant(a)));
    assert_eq!(tree.snapshot(), before);
    assert_eq!(tree.evict_tenant_by_lru(a, 5), 0);
    assert_eq!(tree.char_count(b), Some(3));
}

#[test]
fn stale_ids_never_alias_new_tenants() {
    let tree = PrefixTree::new();
    let mut old = Vec::new();
    for round in 0..50 {
        let t = tree.add_tenant(&format!("t{round}"));
        tree.insert_at(&format!("text {round}"), t, round).unwrap();
        assert!(!old.contains(&t), "id {t:?} reused");
        assert!(tree.remove_tenant(t) > 0);
        tree.collect_garbage();
        old.push(t);
        for &o in &old {
            assert_eq!(tree.char_count(o), None);
            assert_eq!(tree.insert_at("x", o, 1), Err(Error::UnknownTenant(o)));
        }
    }
    assert_eq!(tree.node_count(), 0);
}

#[test]
fn smallest_tenants_among_candidates() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    let c = tree.add_tenant("c");
    tree.insert_at("aaaa", a, 1).unwrap();
    tree.insert_at("bb", b, 1).unwrap();
    assert_eq!(tree.smallest_tenants(None), vec![c]);
    assert_eq!(tree.smallest_tenants(Some(&[a, b])), vec![b]);
    tree.insert_at("cc", c, 1).unwrap();
    assert_eq!(tree.smallest_tenants(None), vec![b, c]);
    assert_eq!(tree.smallest_tenants(Some(&[])), vec![]);
    tree.remove_tenant(b);
    assert_eq!(tree.smallest_tenants(Some(&[b])), vec![]);
    assert_eq!(tree.smallest_tenants(None), vec![c]);
}

#[test]
fn multibyte_chars_are_never_split() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    // é = C3 A9 and è = C3 A8 share their lead byte.
    tree.insert_at("héllo", a, 1).unwrap();
    tree.insert_at("hèllo", b, 2).unwrap();
    assert_eq!(
        tree.snapshot().children,
        vec![node(
            "h",
            vec![(a, 1), (b, 2)],
            vec![
                node("èllo", vec![(b, 2)], vec![]),
                node("éllo", vec![(a, 1)], vec![])
            ]
        )]
    );
    assert_eq!(tree.char_count(a), Some(5));
    assert_eq!(tree.char_count(b), Some(5));
    let m = tree.prefix_match("héllx", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (4, 5, vec![a]));
    let m = tree.prefix_match("hê", None);
    assert_eq!((m.matched_chars, m.matched_bytes), (1, 1));
    // Four-byte chars sharing three leading bytes.
    tree.insert_at("🙂🙂", a, 3).unwrap();
    tree.insert_at("🙂🙃", b, 4).unwrap();
    let m = tree.prefix_match("🙂🙃🙃", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (2, 8, vec![b]));
    let m = tree.prefix_match("🙃", None);
    assert_eq!(m.matched_chars, 0);
    check(&tree);
}

#[test]
fn text_of_only_four_byte_chars() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let s: String = std::iter::repeat_n('🚀', 1000).collect();
    tree.insert_at(&s, a, 1).unwrap();
    let half: String = std::iter::repeat_n('🚀', 500).collect::<String>() + "🎉";
    tree.insert_at(&half, a, 2).unwrap();
    assert_eq!(tree.char_count(a), Some(1001));
    assert_eq!(tree.distinct_bytes(), 4004);
    let m = tree.prefix_match(&s, None);
    assert_eq!((m.matched_chars, m.matched_bytes), (1000, 4000));
    check(&tree);
}

#[test]
fn ten_megabyte_prompt() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let n = if cfg!(miri) { 10_000 } else { 10 << 20 };
    let big = "x".repeat(n);
    tree.insert(&big, a).unwrap();
    assert_eq!(tree.char_count(a), Some(n));
    assert_eq!(tree.prefix_match(&big, None).matched_chars, n);
    let mut other = big.clone();
    other.push('y');
    tree.insert(&other, a).unwrap();
    assert_eq!(tree.char_count(a), Some(n + 1));
    assert_eq!(tree.remove_tenant(a), n + 1);
}

#[test]
fn tenant_names_of_any_content() {
    let tree = PrefixTree::new();
    let names = ["", " ", "\0", "🙂", "名前", "a\nb", "replica-0"];
    let tids: Vec<TenantId> = names.iter().map(|n| tree.add_tenant(n)).collect();
    for (n, t) in names.iter().zip(&tids) {
        assert_eq!(tree.tenant_id(n), Some(*t));
        assert_eq!(&*tree.tenant_name(*t).unwrap(), *n);
    }
    let mut sorted = tids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), names.len());
}

#[test]
fn thousands_of_tenants() {
    let tree = PrefixTree::new();
    let n = if cfg!(miri) { 100 } else { 2048 };
    let tids: Vec<TenantId> = (0..n).map(|i| tree.add_tenant(&format!("r{i}"))).collect();
    for (i, &t) in tids.iter().enumerate() {
        tree.insert_at(&format!("system prompt / user {i}"), t, i as u64)
            .unwrap();
    }
    assert_eq!(tree.tenants().len(), n);
    let last = *tids.last().unwrap();
    let m = tree.prefix_match(&format!("system prompt / user {}", n - 1), None);
    assert_eq!(ids(&m), vec![last]);
    let m = tree.prefix_match("system prompt / x", Some(&[tids[3], last]));
    assert_eq!((m.matched_chars, ids(&m)), (16, vec![tids[3], last]));
    assert_eq!(tree.remove_tenant(tids[0]), 22);
    check(&tree);
}

/// A tenant inserting exactly a path that only other tenants own, edge for edge, becomes an
/// owner of every node on it, and its last node is its leaf.
#[test]
fn inserting_another_tenants_whole_path_attaches_the_tenant() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("hello world", a, 1).unwrap();
    tree.insert_at("hello there", a, 2).unwrap();
    tree.insert_at("hello world", b, 3).unwrap();
    assert_eq!(tree.char_count(b), Some(11));
    let m = tree.prefix_match("hello world", Some(&[b]));
    assert_eq!((m.matched_chars, ids(&m)), (11, vec![b]));
    assert_eq!(
        tree.snapshot(),
        node(
            "",
            vec![(a, 2), (b, 3)],
            vec![node(
                "hello ",
                vec![(a, 2), (b, 3)],
                vec![
                    node("there", vec![(a, 2)], vec![]),
                    node("world", vec![(a, 1), (b, 3)], vec![]),
                ]
            )]
        )
    );
    assert_eq!(tree.evict_tenant_by_lru(b, 1), 11);
    assert_eq!(
        (tree.char_count(a), tree.char_count(b)),
        (Some(16), Some(0))
    );
    check(&tree);
}

/// The text limit is inclusive: a text of `MAX_TEXT_BYTES` bytes is accepted, one byte more
/// is an error that changes nothing.
#[test]
#[cfg_attr(
    miri,
    ignore = "2 GiB of zeroed text: address space natively, memory when interpreted"
)]
fn the_text_length_limit_is_inclusive() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    // Zeroed (NUL chars) and only validated and compared at its start: its pages stay
    // mapped to the zero page.
    let text = String::from_utf8(vec![0u8; MAX_TEXT_BYTES + 1]).unwrap();
    let too_long = Err(Error::TextTooLong {
        len: MAX_TEXT_BYTES + 1,
    });
    let mut m = kvtrie::PrefixMatch::default();
    // `choose` declines: nothing is inserted either way.
    assert_eq!(
        tree.match_and_insert(&text, None, 1, &mut m, |_| None),
        too_long
    );
    assert_eq!(
        tree.match_and_insert(&text[..MAX_TEXT_BYTES], None, 1, &mut m, |_| None),
        Ok(None)
    );
    assert_eq!(tree.insert_at(&text, a, 1), too_long.map(|_| ()));
    assert_eq!(tree.char_count(a), Some(0));
    assert_eq!(tree.node_count(), 0);
}

#[test]
fn prefix_match_into_reuses_storage() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("abc", a, 1).unwrap();
    tree.insert_at("abd", b, 1).unwrap();
    let mut out = kvtrie::PrefixMatch::default();
    tree.prefix_match_into("abc", None, &mut out);
    assert_eq!((out.matched_chars, ids(&out)), (3, vec![a]));
    tree.prefix_match_into("ab", None, &mut out);
    assert_eq!((out.matched_chars, ids(&out)), (2, vec![a, b]));
    assert_eq!(out, tree.prefix_match("ab", None));
}

#[test]
fn stats_count_nodes_chars_bytes() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("héllo", a, 1).unwrap();
    tree.insert_at("hélp", a, 1).unwrap();
    let s = tree.stats();
    assert_eq!((s.nodes, s.chars, s.bytes, s.tenants), (3, 6, 7, 1));
    assert!(s.heap_bytes > s.bytes);
}

#[test]
fn match_and_insert_matches_like_prefix_match_on_deep_paths() {
    // A chain deeper than the recorded-path buffer: "a", "aa", ..., 100 × 'a'.
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    for n in 1..=100 {
        tree.insert_at(&"a".repeat(n), a, n as u64).unwrap();
    }
    let q = "a".repeat(100) + "b";
    let want = tree.prefix_match(&q, None);
    assert_eq!(want.matched_chars, 100);
    let mut got = kvtrie::PrefixMatch::default();
    tree.match_and_insert(&q, None, 200, &mut got, |_| Some(b))
        .unwrap();
    assert_eq!(got, want);
    // The insert went through the whole chain too.
    assert_eq!(tree.char_count(b), Some(101));
    assert_eq!(tree.prefix_match(&q, Some(&[b])).matched_chars, 101);
    // A lock-free re-insert deep in the chain raises the timestamps.
    tree.insert_at(&"a".repeat(100), a, 300).unwrap();
    assert_eq!(
        tree.snapshot().tenants.iter().find(|x| x.0 == a).unwrap().1,
        300
    );
    check(&tree);
}

#[test]
fn too_many_tenants_is_an_error_not_a_panic() {
    const _: () = assert!(kvtrie::MAX_TENANTS >= 1024);
    let tree = PrefixTree::new();
    let t = tree.try_add_tenant("x").unwrap();
    assert_eq!(tree.try_add_tenant("x"), Ok(t));
}

/// A restricted match over tenants whose slots lie beyond the first 1,024 (whose mask words
/// no longer fit the descent's stack buffer) finds their prefixes, alone or with low slots.
#[test]
#[cfg_attr(miri, ignore = "1,100 tenants are slow under miri")]
fn restricted_matches_see_tenants_beyond_the_first_1024_slots() {
    let tree = PrefixTree::new();
    let ts: Vec<TenantId> = (0..1100)
        .map(|i| tree.add_tenant(&format!("t{i}")))
        .collect();
    let (low, high) = (ts[5], ts[1090]);
    assert_eq!(high.slot(), 1090);
    tree.insert_at("hello", high, 1).unwrap();
    tree.insert_at("help", low, 2).unwrap();
    let m = tree.prefix_match("hello", Some(&[high]));
    assert_eq!((m.matched_chars, ids(&m)), (5, vec![high]));
    let m = tree.prefix_match("hello", Some(&[low, high]));
    assert_eq!((m.matched_chars, ids(&m)), (5, vec![high]));
    let m = tree.prefix_match("help", Some(&[high, low]));
    assert_eq!((m.matched_chars, ids(&m)), (4, vec![low]));
    assert_eq!(
        tree.prefix_match("hello", Some(&[ts[1099]])).matched_chars,
        0
    );
    // Routing's match-and-insert masks the same way.
    let mut got = kvtrie::PrefixMatch::default();
    let chosen = tree
        .match_and_insert("hello!", Some(&[high]), 3, &mut got, |m| {
            m.tenants.iter().next()
        })
        .unwrap();
    assert_eq!((chosen, got.matched_chars), (Some(high), 5));
    assert_eq!(tree.char_count(high), Some(6));
    check(&tree);
}

#[test]
fn a_split_prefix_newly_owned_is_evictable() {
    // b's insert ends inside a's "abcd": the split's prefix "ab" becomes b's only node (a leaf
    // of b), so evicting b takes it.
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("abcd", a, 1).unwrap();
    tree.insert_at("ab", b, 2).unwrap();
    assert_eq!(tree.char_count(b), Some(2));
    assert_eq!(tree.evict_tenant_by_lru(b, 1), 2);
    assert_eq!(tree.char_count(b), Some(0));
    assert_eq!(tree.char_count(a), Some(4));
    check(&tree);
}

#[test]
fn a_collected_tenant_set_is_sorted_without_duplicates() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    let set: kvtrie::TenantSet = [b, a, b, a].into_iter().collect();
    assert_eq!(set.as_slice(), &[a, b]);
    assert_eq!(set.len(), 2);
    assert!(set.contains(a) && set.contains(b));
}

/// Siblings whose first chars share all but their last byte (中 is E4 B8 AD, 丸 E4 B8 B8; 🙂
/// F0 9F 99 82, 🙃 F0 9F 99 83) are different edges: a match never takes one for the other
/// and never stops inside a char.
#[test]
fn siblings_whose_first_chars_share_leading_bytes_stay_apart() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("中x", a, 1).unwrap();
    tree.insert_at("丸y", b, 2).unwrap();
    tree.insert_at("🙂p", a, 3).unwrap();
    tree.insert_at("🙃q", b, 4).unwrap();
    let m = tree.prefix_match("丸x", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (1, 3, vec![b]));
    let m = tree.prefix_match("中y", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (1, 3, vec![a]));
    let m = tree.prefix_match("🙃p", None);
    assert_eq!((m.matched_chars, m.matched_bytes, ids(&m)), (1, 4, vec![b]));
    // 丹 (E4 B8 B9) shares two bytes with both and is in neither edge: no match.
    let m = tree.prefix_match("丹", None);
    assert_eq!(
        (m.matched_chars, m.matched_bytes, ids(&m)),
        (0, 0, vec![a, b])
    );
    assert_eq!(
        tree.snapshot(),
        node(
            "",
            vec![(a, 3), (b, 4)],
            vec![
                node("中x", vec![(a, 1)], vec![]),
                node("丸y", vec![(b, 2)], vec![]),
                node("🙂p", vec![(a, 3)], vec![]),
                node("🙃q", vec![(b, 4)], vec![]),
            ]
        )
    );
    assert_eq!((tree.char_count(a), tree.char_count(b)), (Some(4), Some(4)));
    check(&tree);
}

/// `TenantSet`'s queries on an empty and a filled set, its iteration by reference, and
/// `clear` (which empties it for reuse).
#[test]
fn tenant_set_queries_iteration_and_clear() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    let c = tree.add_tenant("c");
    let empty = TenantSet::new();
    assert!(empty.is_empty());
    assert_eq!((empty.len(), empty.as_slice()), (0, &[][..]));
    assert!(!empty.contains(a));
    assert_eq!((&empty).into_iter().count(), 0);
    let mut set: TenantSet = [c, a].into_iter().collect();
    assert!(!set.is_empty());
    assert_eq!(set.len(), 2);
    assert!(set.contains(a) && !set.contains(b) && set.contains(c));
    let mut seen = Vec::new();
    for t in &set {
        seen.push(t);
    }
    assert_eq!(seen, vec![a, c]);
    assert_eq!(set.iter().len(), 2);
    set.clear();
    assert!(set.is_empty());
    assert_eq!((set.len(), set.as_slice()), (0, &[][..]));
    assert_eq!(set, empty);
    // A match's set, like any other.
    tree.insert_at("xyz", b, 1).unwrap();
    let m = tree.prefix_match("xy", None);
    assert!(!m.tenants.is_empty());
    assert_eq!((&m.tenants).into_iter().collect::<Vec<_>>(), vec![b]);
}

/// A `TenantId` prints as `TenantId(slot#generation)`; a `TenantSet` as the set of its ids,
/// in ascending order.
#[test]
fn tenant_ids_and_sets_print_slot_and_generation() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    let g = a.generation();
    assert_eq!((a.slot(), b.slot(), b.generation()), (0, 1, g));
    assert_eq!(format!("{a:?}"), format!("TenantId(0#{g})"));
    let set: TenantSet = [b, a].into_iter().collect();
    assert_eq!(
        format!("{set:?}"),
        format!("{{TenantId(0#{g}), TenantId(1#{g})}}")
    );
    assert_eq!(format!("{:?}", TenantSet::new()), "{}");
}

/// Each tree draws its first generation: odd (live), below 2^30 (over a billion reuses of a
/// slot left), and not one shared by every tree (the chance that 32 trees all drew the same
/// one is 2^-899).
#[test]
fn first_generations_are_odd_below_two_to_the_thirtieth_and_drawn_per_tree() {
    let gens: Vec<u32> = (0..32)
        .map(|_| PrefixTree::new().add_tenant("a").generation())
        .collect();
    for &g in &gens {
        assert_eq!((g & 1, g < 1 << 30), (1, true), "generation {g:#x}");
    }
    assert!(gens.iter().any(|&g| g != gens[0]), "{gens:?}");
}

/// When every live tenant lies in slots 64..127, a match for all tenants uses the root's
/// one-word mask starting at slot 64: it is matched against the owner tables, as the node
/// header's inline copy of the first word (slots 0..63) says nothing about those slots.
#[test]
fn a_match_for_all_tenants_when_all_tenants_lie_past_slot_63() {
    let tree = PrefixTree::new();
    let tids: Vec<TenantId> = (0..71).map(|i| tree.add_tenant(&format!("t{i}"))).collect();
    for &t in tids.iter().filter(|t| t.slot() < 64) {
        tree.remove_tenant(t);
    }
    let by_slot = |s: usize| *tids.iter().find(|t| t.slot() == s).unwrap();
    let (a, b) = (by_slot(65), by_slot(70));
    tree.insert_at("abc-sixty-five", a, 1).unwrap();
    tree.insert_at("abc-seventy", b, 2).unwrap();
    let m = tree.prefix_match("abc-seventy", None);
    assert_eq!((m.matched_chars, ids(&m)), (11, vec![b]));
    let m = tree.prefix_match("abc-sixty", None);
    assert_eq!((m.matched_chars, ids(&m)), (9, vec![a]));
    let m = tree.prefix_match("abc-x", None);
    assert_eq!((m.matched_chars, ids(&m)), (4, vec![a, b]));
    check(&tree);
}
