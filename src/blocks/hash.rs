//! Dynamo-compatible block hashing: xxh3 over full token blocks, chained into sequence hashes.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The default hashing seed (Dynamo's `XXH3_SEED`).
pub const DEFAULT_SEED: u64 = 1337;

/// Hashes token blocks the way NVIDIA Dynamo's KV router does.
///
/// - The **local hash** of a full block of `block_size` tokens is `xxh3_64_with_seed` over the
///   tokens as little-endian `u32` bytes; a trailing partial block is ignored.
/// - The **sequence hash** chains the local hashes: `seq[0] = local[0]`, `seq[i] =
///   xxh3_64_with_seed(le(seq[i-1]) ++ le(local[i]), seed)`.
///
/// Hashing never allocates except for the returned `Vec` (the `_into` forms reuse the caller's).
///
/// ```
/// use kvtrie::BlockHasher;
///
/// let h = BlockHasher::new(4);
/// let tokens: Vec<u32> = (0..10).collect(); // two full blocks and a partial one
/// let local = h.local_hashes(&tokens);
/// assert_eq!(local.len(), 2);
/// let seq = h.sequence_hashes(&tokens);
/// assert_eq!(seq[0], local[0]);
/// assert_eq!(seq[1], h.chain(seq[0], local[1]));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

/// Why a [`BlockHasher`] could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HasherError {
    /// The block size is 0 (a block must hold at least one token).
    ZeroBlockSize,
}

impl core::fmt::Display for HasherError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HasherError::ZeroBlockSize => f.write_str("block size must be positive, got 0"),
        }
    }
}

impl std::error::Error for HasherError {}

impl Default for BlockHasher {
    /// Blocks of 16 tokens (vLLM's and Dynamo's default), seed 1337.
    fn default() -> Self {
        Self {
            block_size: 16,
            seed: DEFAULT_SEED,
        }
    }
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens with the default seed 1337.
    ///
    /// # Panics
    ///
    /// If `block_size == 0`; [`Self::try_new`] returns an error instead.
    pub fn new(block_size: usize) -> Self {
        Self::with_seed(block_size, DEFAULT_SEED)
    }

    /// [`Self::new`], or [`HasherError::ZeroBlockSize`] for a block size of 0.
    ///
    /// ```
    /// use kvtrie::blocks::{BlockHasher, HasherError};
    /// assert_eq!(BlockHasher::try_new(0), Err(HasherError::ZeroBlockSize));
    /// assert_eq!(BlockHasher::try_new(16), Ok(BlockHasher::new(16)));
    /// ```
    pub fn try_new(block_size: usize) -> Result<Self, HasherError> {
        Self::try_with_seed(block_size, DEFAULT_SEED)
    }

    /// A hasher with an explicit seed.
    ///
    /// # Panics
    ///
    /// If `block_size == 0`; [`Self::try_with_seed`] returns an error instead.
    pub fn with_seed(block_size: usize, seed: u64) -> Self {
        match Self::try_with_seed(block_size, seed) {
            Ok(h) => h,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::with_seed`], or [`HasherError::ZeroBlockSize`] for a block size of 0.
    pub fn try_with_seed(block_size: usize, seed: u64) -> Result<Self, HasherError> {
        if block_size == 0 {
            return Err(HasherError::ZeroBlockSize);
        }
        Ok(Self { block_size, seed })
    }

    /// This hasher salted with a LoRA adapter name and a namespace:
    /// `seed = 1337 + xxh3(lora_name, 0) + xxh3(namespace, 1)` (wrapping); an empty string
    /// contributes nothing.
    ///
    /// ```
    /// use kvtrie::BlockHasher;
    /// let plain = BlockHasher::new(16);
    /// assert_eq!(plain.with_salt("", "").seed(), plain.seed());
    /// assert_ne!(plain.with_salt("my-lora", "").seed(), plain.seed());
    /// ```
    pub fn with_salt(&self, lora_name: &str, namespace: &str) -> Self {
        let mut seed = DEFAULT_SEED;
        if !lora_name.is_empty() {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora_name.as_bytes(), 0));
        }
        if !namespace.is_empty() {
            seed = seed.wrapping_add(xxh3_64_with_seed(namespace.as_bytes(), 1));
        }
        Self {
            block_size: self.block_size,
            seed,
        }
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The seed of every hash this hasher computes.
    #[inline]
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The number of full blocks in `tokens`.
    #[inline]
    pub fn full_blocks(&self, tokens: &[u32]) -> usize {
        tokens.len() / self.block_size
    }

    /// The local hash of one block of tokens (of any length; callers pass full blocks).
    /// Does not allocate.
    #[inline]
    pub fn hash_block(&self, block: &[u32]) -> u64 {
        hash_u32s(block, self.seed)
    }

    /// The sequence hash of a block whose predecessor has sequence hash `prev_seq` and whose
    /// own local hash is `local`.
    #[inline]
    pub fn chain(&self, prev_seq: u64, local: u64) -> u64 {
        chain(prev_seq, local, self.seed)
    }

    /// Local hashes of every full block of `tokens`.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens));
        self.local_hashes_into(tokens, &mut out);
        out
    }

    /// [`Self::local_hashes`] into `out` (cleared first); allocates only if `out` must grow.
    pub fn local_hashes_into(&self, tokens: &[u32], out: &mut Vec<u64>) {
        out.clear();
        out.extend(
            tokens
                .chunks_exact(self.block_size)
                .map(|b| hash_u32s(b, self.seed)),
        );
    }

    /// Sequence hashes of every full block of `tokens`.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens));
        self.sequence_hashes_into(tokens, &mut out);
        out
    }

    /// [`Self::sequence_hashes`] into `out` (cleared first); allocates only if `out` must grow.
    pub fn sequence_hashes_into(&self, tokens: &[u32], out: &mut Vec<u64>) {
        out.clear();
        let mut prev = None;
        out.extend(tokens.chunks_exact(self.block_size).map(|b| {
            let local = hash_u32s(b, self.seed);
            let seq = match prev {
                None => local,
                Some(p) => chain(p, local, self.seed),
            };
            prev = Some(seq);
            seq
        }));
    }

    /// Chains already computed local hashes into sequence hashes.
    pub fn chain_local(&self, local: &[u64]) -> Vec<u64> {
        let mut out = Vec::with_capacity(local.len());
        self.chain_local_into(local, &mut out);
        out
    }

    /// [`Self::chain_local`] into `out` (cleared first).
    pub fn chain_local_into(&self, local: &[u64], out: &mut Vec<u64>) {
        out.clear();
        let mut prev = None;
        out.extend(local.iter().map(|&l| {
            let seq = match prev {
                None => l,
                Some(p) => chain(p, l, self.seed),
            };
            prev = Some(seq);
            seq
        }));
    }
}

/// What vLLM hashes into a request's blocks besides their tokens: the cache partition of the
/// request. Requests that differ in any of these never share cached blocks in vLLM, and the
/// request-side hashes ([`BlockHasher::local_hashes_with`]) differ the same way.
///
/// vLLM (`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`) adds to each
/// block's hash a tuple of extra keys: the LoRA name (every block), `(identifier, offset of the
/// item relative to the block start)` for every multimodal item overlapping the block, and the
/// `cache_salt` (first block only); it publishes that tuple per block in `BlockStored`'s
/// `extra_keys`. kvtrie salts the seed with the LoRA (as Dynamo does: `seed + xxh3(lora, 0)`,
/// the same as [`BlockHasher::with_salt`]) and hashes the rest of a block's keys after its
/// tokens, so the request side and the event decoder agree.
///
/// ```
/// use kvtrie::blocks::{BlockHasher, CacheKeys, MmInput};
/// let h = BlockHasher::new(4);
/// let tokens: Vec<u32> = (0..16).collect();
/// let image = [MmInput { identifier: "img-1", offset: 6, length: 4 }];
/// let keys = CacheKeys { cache_salt: Some("tenant-a"), mm_inputs: &image, ..CacheKeys::default() };
/// let salted = h.local_hashes_with(&tokens, &keys);
/// let plain = h.local_hashes(&tokens);
/// // The salt changes block 0, the image blocks 1 and 2; block 3 hashes as usual (its
/// // sequence hash still differs: it chains from block 0).
/// assert_ne!(salted[0], plain[0]);
/// assert_ne!(salted[1], plain[1]);
/// assert_ne!(salted[2], plain[2]);
/// assert_eq!(salted[3], plain[3]);
/// assert_eq!(h.local_hashes_with(&tokens, &CacheKeys::default()), plain);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheKeys<'a> {
    /// The request's LoRA adapter name (vLLM's `lora_request.lora_name`).
    pub lora_name: Option<&'a str>,
    /// The LoRA adapter's integer id, for engines that publish only `lora_id` (older vLLM
    /// releases); ignored when `lora_name` is set.
    pub lora_id: Option<u64>,
    /// The request's `cache_salt` (an empty salt is none, as in vLLM).
    pub cache_salt: Option<&'a str>,
    /// The request's multimodal items, sorted by offset as vLLM keeps them.
    pub mm_inputs: &'a [MmInput<'a>],
}

/// One multimodal item of a request: its placeholder tokens `offset .. offset + length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmInput<'a> {
    /// The item's identifier (vLLM's `mm_feature.identifier`, usually a content hash).
    pub identifier: &'a str,
    /// Index of the item's first placeholder token in the request.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// Canonical encoding of vLLM extra hash keys (self-delimiting, one tag byte per value), so
/// that keys built by the request-side hasher and keys decoded from msgpack hash the same.
#[cfg_attr(not(feature = "vllm"), allow(dead_code))]
pub(crate) mod keys {
    const STR: u8 = 1;
    const INT: u8 = 2;
    const UINT: u8 = 3;
    const BIN: u8 = 4;
    const LIST: u8 = 5;
    const NIL: u8 = 6;
    const BOOL: u8 = 7;
    const FLOAT: u8 = 8;
    const MAP: u8 = 9;
    const EXT: u8 = 10;

    fn bytes(out: &mut Vec<u8>, tag: u8, b: &[u8]) {
        out.push(tag);
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }

    pub(crate) fn str(out: &mut Vec<u8>, s: &[u8]) {
        bytes(out, STR, s)
    }
    pub(crate) fn bin(out: &mut Vec<u8>, b: &[u8]) {
        bytes(out, BIN, b)
    }
    pub(crate) fn ext(out: &mut Vec<u8>, t: i8, b: &[u8]) {
        out.push(EXT);
        out.push(t as u8);
        bytes(out, BIN, b)
    }
    /// Any integer: those that fit `i64` one way, larger ones another.
    pub(crate) fn int(out: &mut Vec<u8>, v: i128) {
        match i64::try_from(v) {
            Ok(v) => {
                out.push(INT);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Err(_) => {
                out.push(UINT);
                out.extend_from_slice(&(v as u64).to_le_bytes());
            }
        }
    }
    pub(crate) fn list(out: &mut Vec<u8>, n: usize) {
        out.push(LIST);
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    pub(crate) fn map(out: &mut Vec<u8>, n: usize) {
        out.push(MAP);
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    pub(crate) fn nil(out: &mut Vec<u8>) {
        out.push(NIL)
    }
    pub(crate) fn bool(out: &mut Vec<u8>, b: bool) {
        out.push(BOOL);
        out.push(u8::from(b));
    }
    pub(crate) fn float(out: &mut Vec<u8>, f: f64) {
        out.push(FLOAT);
        out.extend_from_slice(&f.to_bits().to_le_bytes());
    }
}

/// The seed of a request's LoRA partition: `seed + xxh3(lora_name, 0)` (as
/// [`BlockHasher::with_salt`]), or `seed + xxh3(le(lora_id), 2)` when only an id is known.
pub(crate) fn lora_seed(seed: u64, lora_name: Option<&str>, lora_id: Option<u64>) -> u64 {
    match (lora_name.filter(|n| !n.is_empty()), lora_id) {
        (Some(name), _) => seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0)),
        (None, Some(id)) => seed.wrapping_add(xxh3_64_with_seed(&id.to_le_bytes(), 2)),
        (None, None) => seed,
    }
}

/// The local hash of a block of `tokens` with canonical extra keys `extra` (none: the plain
/// block hash).
pub(crate) fn hash_block_keyed(tokens: &[u32], extra: &[u8], seed: u64) -> u64 {
    if extra.is_empty() {
        return hash_u32s(tokens, seed);
    }
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (d, t) in buf.chunks_exact_mut(4).zip(chunk) {
            d.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.update(extra);
    h.digest()
}

impl BlockHasher {
    /// Local hashes of every full block of `tokens` in the cache partition `keys` (see
    /// [`CacheKeys`]); equal to [`Self::local_hashes`] when `keys` is empty. Chain them with
    /// this hasher's seed (as [`crate::blocks::BlockIndex::find_matches`] does).
    ///
    /// Blocks are this hasher's blocks: for the hashes to match an engine's, the engine's
    /// block size must equal this hasher's when multimodal items or a salt are present.
    pub fn local_hashes_with(&self, tokens: &[u32], keys: &CacheKeys<'_>) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens));
        self.local_hashes_with_into(tokens, keys, &mut out);
        out
    }

    /// [`Self::local_hashes_with`] into `out` (cleared first).
    pub fn local_hashes_with_into(&self, tokens: &[u32], keys: &CacheKeys<'_>, out: &mut Vec<u64>) {
        out.clear();
        let seed = lora_seed(self.seed, keys.lora_name, keys.lora_id);
        let salt = keys.cache_salt.filter(|s| !s.is_empty());
        if salt.is_none() && keys.mm_inputs.is_empty() {
            out.extend(
                tokens
                    .chunks_exact(self.block_size)
                    .map(|b| hash_u32s(b, seed)),
            );
            return;
        }
        let mut extra = Vec::new();
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            extra.clear();
            let start = i * self.block_size;
            let end = start + self.block_size;
            for m in keys.mm_inputs {
                // vLLM: the item overlaps [start, end) (a zero-length item sits inside it).
                if m.offset < end && start < m.offset.saturating_add(m.length) {
                    keys::list(&mut extra, 2);
                    keys::str(&mut extra, m.identifier.as_bytes());
                    keys::int(&mut extra, m.offset as i128 - start as i128);
                }
            }
            if let (0, Some(s)) = (i, salt) {
                keys::str(&mut extra, s.as_bytes());
            }
            out.push(hash_block_keyed(block, &extra, seed));
        }
    }
}

/// `xxh3_64_with_seed(le(prev) ++ le(local), seed)`.
#[inline]
pub(crate) fn chain(prev: u64, local: u64, seed: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// xxh3 of `tokens` as little-endian `u32` bytes, without allocating.
#[inline]
pub(crate) fn hash_u32s(tokens: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // Safety: `u32` has no padding and every byte pattern is a valid `u8`; `u8` has
        // alignment 1; the byte slice covers exactly the `size_of_val(tokens)` bytes of the
        // borrowed `tokens` slice and lives no longer than that borrow. On a little-endian
        // target these bytes are the little-endian encoding the hash is defined over.
        let bytes = unsafe {
            core::slice::from_raw_parts(
                tokens.as_ptr().cast::<u8>(),
                core::mem::size_of_val(tokens),
            )
        };
        xxh3_64_with_seed(bytes, seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut buf = [0u8; 256];
        if tokens.len() <= 64 {
            for (d, t) in buf.chunks_exact_mut(4).zip(tokens) {
                d.copy_from_slice(&t.to_le_bytes());
            }
            return xxh3_64_with_seed(&buf[..tokens.len() * 4], seed);
        }
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for chunk in tokens.chunks(64) {
            for (d, t) in buf.chunks_exact_mut(4).zip(chunk) {
                d.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        h.digest()
    }
}

/// Streaming form of [`hash_u32s`], used only to cross-check the fast path in tests.
#[cfg(test)]
fn hash_u32s_streaming(tokens: &[u32], seed: u64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_vector() {
        assert_eq!(
            xxh3_64_with_seed(b"test data", 1337),
            13_226_331_709_069_118_873
        );
    }

    #[test]
    fn keyed_hash_without_keys_is_the_plain_hash() {
        let toks: Vec<u32> = (0..100u32).collect();
        for n in [0, 1, 16, 64, 65, 100] {
            assert_eq!(
                hash_block_keyed(&toks[..n], &[], 9),
                hash_u32s(&toks[..n], 9)
            );
            let mut bytes: Vec<u8> = toks[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
            bytes.extend_from_slice(b"xyz");
            assert_eq!(
                hash_block_keyed(&toks[..n], b"xyz", 9),
                xxh3_64_with_seed(&bytes, 9)
            );
        }
        assert_eq!(lora_seed(5, None, None), 5);
        assert_eq!(lora_seed(5, Some(""), None), 5);
        assert_ne!(lora_seed(5, None, Some(1)), 5);
        assert_eq!(
            lora_seed(5, Some("a"), Some(1)),
            lora_seed(5, Some("a"), None)
        );
    }

    #[test]
    fn fast_path_matches_streaming() {
        let toks: Vec<u32> = (0..100u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        for n in [0, 1, 16, 64, 65, 100] {
            assert_eq!(
                hash_u32s(&toks[..n], 1337),
                hash_u32s_streaming(&toks[..n], 1337)
            );
        }
    }
}
