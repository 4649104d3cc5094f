//! SplitMix64: the crate's one pseudo-random source (workloads, the simulator, the routers'
//! seeded streams and id hashing all use this mix).

/// SplitMix64's increment (the golden ratio).
pub(crate) const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output mix: a bijective 64-bit hash.
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64, the random source every workload is generated from.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

/// The 64 symbols of workload W3: 26 ASCII letters, 14 two-byte, 14 three-byte and 10
/// four-byte characters, in that order.
pub const UNICODE_ALPHABET: [char; 64] = [
    'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j', 'k', 'l', 'm', 'n', 'o', 'p', 'q', 'r', 's',
    't', 'u', 'v', 'w', 'x', 'y', 'z', 'é', 'ж', 'ß', 'ğ', 'ø', 'ł', 'ñ', 'ç', 'ü', 'ö', 'ä', 'å',
    'π', 'λ', '中', '文', '字', '日', '本', '語', '한', '국', '어', '→', '∑', '∞', '€', '₹', '🙂',
    '🚀', '🎉', '🔥', '💡', '🌍', '🍕', '🎵', '🧠', '🐍',
];

impl SplitMix64 {
    /// A generator with the given seed.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// `next() % n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `len` ASCII lowercase letters (the W1 alphabet).
    pub fn text(&mut self, len: usize) -> String {
        (0..len)
            .map(|_| (b'a' + self.below(26) as u8) as char)
            .collect()
    }

    /// `len` chars from [`UNICODE_ALPHABET`] (the W3 alphabet).
    pub fn unicode_text(&mut self, len: usize) -> String {
        (0..len)
            .map(|_| UNICODE_ALPHABET[self.below(64) as usize])
            .collect()
    }

    /// `len` tokens in `0..32000` (the W4 vocabulary).
    pub fn tokens(&mut self, len: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(32_000) as u32).collect()
    }
}
