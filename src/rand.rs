//! Counter-based random numbers: Philox 4x32-10 (Salmon et al., SC'11, "Parallel random numbers:
//! as easy as 1, 2, 3"), the generator cuRAND and PyTorch's CUDA backend use.
//!
//! Every random number in colotrain is a pure function of a key and a counter, so a sample does
//! not depend on batch composition, arrival order or device; the CUDA kernels implement the same
//! function. Owns no state. May call: nothing.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox 4x32 with 10 rounds.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for r in 0..10 {
        if r > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// A uniform double in [0, 1) from two 32-bit words (53 random bits).
#[inline]
pub fn uniform_f64(a: u32, b: u32) -> f64 {
    let bits = (((a as u64) << 32) | b as u64) >> 11;
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The key of a seed (its two 32-bit halves).
#[inline]
pub fn seed_key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The uniform that decides the token sampled at `position` of sample `sample` of request
/// `request` under `seed`. Counter layout: (position, sample, request lo, request hi).
#[inline]
pub fn sampling_uniform(seed: u64, request: u64, sample: u32, position: u32) -> f64 {
    let r = philox4x32_10([position, sample, request as u32, (request >> 32) as u32], seed_key(seed));
    uniform_f64(r[0], r[1])
}

/// FNV-1a 64-bit hash, used to derive stream keys from names (e.g. a tensor's name).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A sequential stream over Philox blocks for bulk draws (initialization, noise, bootstrap):
/// block i of stream `stream` under `seed` is philox(counter = (i lo, i hi, stream lo, stream hi)).
#[derive(Clone, Debug)]
pub struct Stream {
    key: [u32; 2],
    stream: u64,
    block: u64,
    buf: [u32; 4],
    used: usize,
}

impl Stream {
    pub fn new(seed: u64, stream: u64) -> Stream {
        Stream { key: seed_key(seed), stream, block: 0, buf: [0; 4], used: 4 }
    }

    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.used == 4 {
            let c = [self.block as u32, (self.block >> 32) as u32, self.stream as u32, (self.stream >> 32) as u32];
            self.buf = philox4x32_10(c, self.key);
            self.block += 1;
            self.used = 0;
        }
        let x = self.buf[self.used];
        self.used += 1;
        x
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        let a = self.next_u32();
        let b = self.next_u32();
        uniform_f64(a, b)
    }

    /// Uniform integer in [0, n) (n > 0), by rejection (no modulo bias).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Stream::below(0)");
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = ((self.next_u32() as u64) << 32) | self.next_u32() as u64;
            if x < zone {
                return x % n;
            }
        }
    }

    /// Standard normal (Box–Muller, one value per two uniforms).
    #[inline]
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known-answer vectors of Random123 (kat_vectors, philox4x32_10).
    #[test]
    fn philox_known_answers() {
        assert_eq!(philox4x32_10([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_and_normal_moments() {
        let mut s = Stream::new(7, 3);
        let n = 200_000;
        let (mut su, mut sn, mut sn2) = (0.0, 0.0, 0.0);
        for _ in 0..n {
            let u = s.uniform();
            assert!((0.0..1.0).contains(&u));
            su += u;
            let z = s.normal();
            sn += z;
            sn2 += z * z;
        }
        let n = n as f64;
        // Standard errors: uniform mean 0.29/sqrt(n) = 6.5e-4, normal mean 2.2e-3, var 3.2e-3.
        assert!((su / n - 0.5).abs() < 4e-3);
        assert!((sn / n).abs() < 1.2e-2);
        assert!((sn2 / n - 1.0).abs() < 1.6e-2);
    }

    #[test]
    fn below_is_in_range_and_covers() {
        let mut s = Stream::new(1, 1);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[s.below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800 && c < 1200), "{seen:?}");
    }
}
