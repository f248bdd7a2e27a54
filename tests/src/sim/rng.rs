//! The simulator's one PRNG: SplitMix64. Written here rather than taken from
//! a crate so that a seed replays the same run forever, whatever version of
//! a random-number crate the workspace later moves to.

#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        debug_assert!(low <= high);
        low + self.next_u64() % (high - low + 1)
    }

    /// True with probability `p` (0.0–1.0).
    pub fn chance(&mut self, p: f64) -> bool {
        // 53 random bits as a fraction in [0, 1).
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A probability drawn uniformly in `0..=max` (swarm testing: each run
    /// draws its own fault rates).
    pub fn rate(&mut self, max: f64) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * max
    }

    /// Uniform in `low..=high` for small counts and indices.
    pub fn index(&mut self, low: usize, high: usize) -> usize {
        let span = (high - low + 1) as u64;
        low + usize::try_from(self.next_u64() % span).expect("below a usize")
    }
}
