//! UTF-8 helpers: common-prefix length snapped to char boundaries, char counting, edge keys.
//!
//! Edges of the tree are byte strings that are always valid UTF-8 and always split at char
//! boundaries. Two different chars may share leading bytes (`é` = `C3 A9`, `è` = `C3 A8`), so the
//! byte-level common prefix is snapped back to the start of the char it ends in.

/// Is `b` a UTF-8 continuation byte (`0b10xx_xxxx`)?
#[inline]
pub(crate) fn is_continuation(b: u8) -> bool {
    (b as i8) < -0x40
}

/// Length in bytes of the longest common prefix of `a` and `b`: 32-byte blocks compared as
/// fixed-size arrays (vectorized), then 8-byte words, then bytes.
#[inline]
pub(crate) fn common_prefix_bytes(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + 32 <= n {
        let x: &[u8; 32] = a[i..i + 32].try_into().unwrap();
        let y: &[u8; 32] = b[i..i + 32].try_into().unwrap();
        if x != y {
            break;
        }
        i += 32;
    }
    while i + 8 <= n {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().unwrap());
        let y = u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let d = x ^ y;
        if d != 0 {
            return i + (d.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Does `rest` start with all of `edge`? (One `memcmp`: the common case of a walk.)
#[inline]
pub(crate) fn starts_with(rest: &[u8], edge: &[u8]) -> bool {
    rest.len() >= edge.len() && &rest[..edge.len()] == edge
}

/// Length in bytes of the longest common prefix of two valid UTF-8 strings that ends on a char
/// boundary of both.
#[inline]
pub(crate) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let mut n = common_prefix_bytes(a, b);
    // Both inputs are valid UTF-8 and agree on [0, n). If n is inside a char of `a`, that char
    // started before n (a[n] is a continuation byte) and differs in `b`: back up to its start.
    // If n == a.len(), `a` ends on a boundary; then b[..n] == a is valid UTF-8 on its own, so n
    // is a boundary of `b` too (and symmetrically).
    if n < a.len() && n < b.len() {
        while n > 0 && is_continuation(a[n]) {
            n -= 1;
        }
    }
    n
}

/// Is `s` pure ASCII? 32 bytes per step, without branching on each word (`<[u8]>::is_ascii`
/// tests 8 bytes per step): every new edge's text goes through here (a leaf's tail is often
/// hundreds of bytes).
#[inline]
pub(crate) fn is_ascii(s: &[u8]) -> bool {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut chunks = s.chunks_exact(32);
    let mut acc = 0u64;
    for c in &mut chunks {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&c[i..i + 8]);
            u64::from_ne_bytes(w)
        };
        acc |= word(0) | word(8) | word(16) | word(24);
    }
    acc & HIGH == 0 && chunks.remainder().is_ascii()
}

/// Number of chars (Unicode scalar values) in valid UTF-8 `s`.
#[inline]
pub(crate) fn char_count(s: &[u8]) -> usize {
    s.iter().filter(|&&b| !is_continuation(b)).count()
}

/// Byte length of the UTF-8 char starting with lead byte `b`.
#[inline]
pub(crate) fn char_width(b: u8) -> usize {
    match b {
        0x00..=0x7F => 1,
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        _ => 4,
    }
}

/// The key of an edge: its first char's UTF-8 bytes packed big-endian into a `u32` (so keys
/// order like the bytes, hence like the chars). `s` is non-empty valid UTF-8.
#[inline]
pub(crate) fn edge_key(s: &[u8]) -> u32 {
    let b0 = s[0];
    if b0 < 0x80 {
        return (b0 as u32) << 24;
    }
    let w = char_width(b0).min(s.len());
    let mut k = 0u32;
    for (i, &b) in s[..w].iter().enumerate() {
        k |= (b as u32) << (24 - 8 * i);
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agrees with `<[u8]>::is_ascii` for one non-ASCII byte at every position of texts of
    /// every length around the 32-byte steps.
    #[test]
    fn is_ascii_agrees_with_std() {
        for len in 0..100 {
            let mut b = vec![b'a'; len];
            assert!(is_ascii(&b), "{len}");
            for at in 0..len {
                b[at] = 0x80;
                assert!(!is_ascii(&b), "{len} {at}");
                b[at] = b'a';
            }
        }
        assert!(!is_ascii((("x".repeat(40)) + "é").as_bytes()));
    }

    /// `is_ascii` sees two non-ASCII bytes at the same offset of two different 8-byte words
    /// of a 32-byte step (their high bits must not cancel out).
    #[test]
    fn is_ascii_sees_non_ascii_bytes_in_two_words_of_a_step() {
        for first in 0..24 {
            let mut b = vec![b'a'; 32];
            b[first] = 0x80;
            b[first + 8] = 0x80;
            assert!(!is_ascii(&b), "{first}");
        }
    }

    #[test]
    fn common_prefix_snaps_to_char_boundary() {
        assert_eq!(common_prefix("é".as_bytes(), "è".as_bytes()), 0);
        assert_eq!(common_prefix("aé".as_bytes(), "aè".as_bytes()), 1);
        assert_eq!(common_prefix("🙂x".as_bytes(), "🙃x".as_bytes()), 0);
        assert_eq!(common_prefix("hello".as_bytes(), "help".as_bytes()), 3);
        assert_eq!(common_prefix("abc".as_bytes(), "abc".as_bytes()), 3);
        assert_eq!(common_prefix("ab".as_bytes(), "abc".as_bytes()), 2);
        assert_eq!(common_prefix("".as_bytes(), "abc".as_bytes()), 0);
        let long_a = "x".repeat(20) + "中文";
        let long_b = "x".repeat(20) + "中字";
        assert_eq!(common_prefix(long_a.as_bytes(), long_b.as_bytes()), 23);
    }

    #[test]
    fn counts_chars() {
        assert_eq!(char_count("héllo🙂".as_bytes()), 6);
        assert_eq!(char_count(b""), 0);
    }

    #[test]
    fn keys_distinguish_chars_sharing_lead_bytes() {
        assert_ne!(edge_key("é".as_bytes()), edge_key("è".as_bytes()));
        assert_ne!(edge_key("🙂".as_bytes()), edge_key("🙃".as_bytes()));
        assert_eq!(edge_key("ab".as_bytes()), edge_key("ac".as_bytes()));
        assert!(edge_key(b"a") < edge_key("é".as_bytes()));
    }

    #[test]
    fn widths_and_keys_take_every_byte_of_a_char() {
        assert_eq!(
            ["a", "é", "中", "🙂"].map(|c| char_width(c.as_bytes()[0])),
            [1, 2, 3, 4]
        );
        // The whole first char, big-endian: two three-byte chars that share their first two
        // bytes (中 = E4 B8 AD, 丸 = E4 B8 B8) have different keys.
        assert_eq!(edge_key("中x".as_bytes()), 0xE4B8_AD00);
        assert_eq!(edge_key("丸".as_bytes()), 0xE4B8_B800);
        assert_eq!(edge_key("éx".as_bytes()), 0xC3A9_0000);
        assert_eq!(edge_key("🙂".as_bytes()), 0xF09F_9982);
    }
}
