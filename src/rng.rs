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
#[cfg(any(feature = "testing", feature = "sim"))]
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

#[cfg(any(feature = "testing", feature = "sim"))]
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
}
