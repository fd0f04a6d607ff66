//! Minifloat encodings with round-to-nearest-even and saturation (PTX `cvt.rn.satfinite`):
//! E4M3 (fn: bias 7, max 448, no inf), E5M2 (bias 15, max 57344) and E2M1 (bias 1, values
//! {0, 0.5, 1, 1.5, 2, 3, 4, 6}). Codes are sign << (E+M) | magnitude. Encoding works on the f32
//! bits (no tables, no branches on the value beyond normal/subnormal), decoding by formula.
//! Non-finite inputs are the caller's to reject (quantizing a tensor checks its amax first);
//! here NaN encodes as the format's NaN where it has one and as max otherwise.

/// A minifloat format: exponent bits, mantissa bits, bias, largest finite magnitude code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Minifloat {
    pub e: u32,
    pub m: u32,
    pub bias: i32,
    pub max_code: u32,
    pub nan_code: Option<u32>,
}

pub const E4M3: Minifloat = Minifloat { e: 4, m: 3, bias: 7, max_code: 0x7E, nan_code: Some(0x7F) };
pub const E5M2: Minifloat = Minifloat { e: 5, m: 2, bias: 15, max_code: 0x7B, nan_code: Some(0x7F) };
pub const E2M1: Minifloat = Minifloat { e: 2, m: 1, bias: 1, max_code: 0x7, nan_code: None };

impl Minifloat {
    fn sign_shift(&self) -> u32 {
        self.e + self.m
    }

    /// Largest finite value.
    pub fn max(&self) -> f32 {
        self.decode(self.max_code as u8)
    }

    /// Round-to-nearest-even, saturating.
    #[inline(always)]
    pub fn encode(&self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = (bits >> 31) << self.sign_shift();
        let abs = bits & 0x7FFF_FFFF;
        if abs > 0x7F80_0000 {
            return (sign | self.nan_code.unwrap_or(self.max_code)) as u8;
        }
        let e = (abs >> 23) as i32 - 127;
        let min_normal = 1 - self.bias;
        let mag = if e < min_normal {
            // Subnormal in the target (or zero): multiples of 2^(min_normal − m), exact scaling.
            let scaled = f32::from_bits(abs) * f32::from_bits(((self.m as i32 - min_normal + 127) as u32) << 23);
            scaled.round_ties_even() as u32
        } else {
            let shift = 23 - self.m;
            let mant = abs & 0x7F_FFFF;
            let code = (((e + self.bias) as u32) << self.m) | (mant >> shift);
            let rem = mant & ((1 << shift) - 1);
            let half = 1 << (shift - 1);
            if rem > half || (rem == half && code & 1 == 1) {
                code + 1
            } else {
                code
            }
        };
        (sign | mag.min(self.max_code)) as u8
    }

    /// The value of a code (NaN code → NaN).
    #[inline(always)]
    pub fn decode(&self, c: u8) -> f32 {
        let c = c as u32;
        let neg = (c >> self.sign_shift()) & 1 == 1;
        let mag = c & ((1 << self.sign_shift()) - 1);
        if Some(mag) == self.nan_code {
            return f32::NAN;
        }
        let exp = mag >> self.m;
        let man = mag & ((1 << self.m) - 1);
        let v = if exp == 0 {
            man as f32 * pow2(1 - self.bias - self.m as i32)
        } else {
            (1.0 + man as f32 * pow2(-(self.m as i32))) * pow2(exp as i32 - self.bias)
        };
        if neg {
            -v
        } else {
            v
        }
    }

    /// The 2^(E+M+1) values of every code (NaN where the code is NaN).
    pub fn table(&self) -> Vec<f32> {
        (0..1u32 << (self.sign_shift() + 1)).map(|c| self.decode(c as u8)).collect()
    }
}

#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// E4M3 decode table (index = code).
pub fn e4m3_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = [0.0f32; 256];
        for (c, v) in t.iter_mut().enumerate() {
            *v = E4M3.decode(c as u8);
        }
        t
    })
}

/// E2M1 decode table (index = 4-bit code).
pub const E2M1_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: nearest representable magnitude, ties to the even code, saturating.
    fn reference(f: &Minifloat, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 1u32 << f.sign_shift() } else { 0 };
        if x.is_infinite() {
            return (sign | f.max_code) as u8;
        }
        let a = x.abs() as f64;
        let mut best = 0u32;
        for c in 0..=f.max_code {
            let (bv, cv) = (f.decode(best as u8) as f64, f.decode(c as u8) as f64);
            let (db, dc) = ((a - bv).abs(), (a - cv).abs());
            if dc < db || (dc == db && c % 2 == 0) {
                best = c;
            }
        }
        (sign | best) as u8
    }

    #[test]
    fn known_values() {
        assert_eq!(E4M3.max(), 448.0);
        assert_eq!(E5M2.max(), 57344.0);
        assert_eq!(E2M1.max(), 6.0);
        assert_eq!(E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(E4M3.encode(1.0), 0x38);
        assert_eq!(E4M3.encode(-1.0), 0xB8);
        assert_eq!(E4M3.encode(1e9), 0x7E);
        assert_eq!(E4M3.encode(f32::NEG_INFINITY), 0xFE);
        for (i, v) in E2M1_VALUES.iter().enumerate() {
            assert_eq!(E2M1.decode(i as u8), *v);
        }
        // The RNE ties of the NVFP4 recipe: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4.
        for (x, want) in
            [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (7.0, 6.0)]
        {
            assert_eq!(E2M1.decode(E2M1.encode(x)), want, "{x}");
        }
    }

    #[test]
    fn bit_encoder_equals_brute_force() {
        let mut s = crate::rand::Stream::new(3, 3);
        for f in [E4M3, E5M2, E2M1] {
            let t = f.table();
            let mut xs: Vec<f32> = Vec::new();
            for c in 0..=f.max_code {
                let v = t[c as usize];
                xs.push(v);
                if c < f.max_code {
                    let mid = ((v as f64 + t[c as usize + 1] as f64) / 2.0) as f32;
                    xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
                }
            }
            for _ in 0..20000 {
                xs.push(((s.uniform() * 2.0 - 1.0) * f.max() as f64 * 1.2 * s.uniform().powi(6)) as f32);
            }
            xs.extend([1e-45, 1e-30, f.max() * 1.01, f32::INFINITY]);
            for &x in &xs {
                for x in [x, -x] {
                    assert_eq!(f.encode(x), reference(&f, x), "{f:?} {x:e}");
                }
            }
        }
    }
}

/// E4M3 (satfinite, RNE) without branches on the value, for vectorized loops (integer ops and
/// selects only; no float→int conversion). Equal to `E4M3.encode` for every non-NaN input
/// (tested on a dense sample of all f32 bit patterns).
#[inline(always)]
pub fn encode_e4m3_fast(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range: round the f32 mantissa to 3 bits (ties to even), then rebias 127 → 7.
    let rounded = (abs + 0x7_FFFF + ((abs >> 20) & 1)) >> 20;
    let normal = (rounded as i32 - (120 << 3)).min(0x7E) as u32;
    // Subnormal range (|x| < 2^-6): multiples of 2^-9; adding 1.5·2^23 rounds to an integer
    // that sits in the low mantissa bits.
    let sub = (f32::from_bits(abs) * 512.0 + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    let mag = if abs < 0x3C80_0000 { sub } else { normal };
    // At or above 2^16 (including inf) the rounding add could wrap: saturate.
    let mag = if abs >= 0x4780_0000 { 0x7E } else { mag };
    (sign | mag) as u8
}

/// E2M1 code (RNE, saturating at ±6) of v, without branches: the magnitude code counts the
/// round-to-nearest-even thresholds below |v| (ties 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2,
/// 3.5→4, 5→4 decide between > and ≥).
#[inline(always)]
pub fn encode_e2m1_fast(v: f32) -> u8 {
    let a = v.abs();
    let code = (a > 0.25) as u32
        + (a >= 0.75) as u32
        + (a > 1.25) as u32
        + (a >= 1.75) as u32
        + (a > 2.5) as u32
        + (a >= 3.5) as u32
        + (a > 5.0) as u32;
    (((v.to_bits() >> 28) & 0x8) | code) as u8
}

#[cfg(test)]
mod fast_tests {
    use super::*;

    #[test]
    fn fast_encoders_equal_the_reference_encoders() {
        // Every 4093rd f32 bit pattern (~1M values across all exponents), plus all E2M1 ties.
        let mut n = 0u64;
        let mut b: u64 = 0;
        while b <= u32::MAX as u64 {
            let x = f32::from_bits(b as u32);
            if !x.is_nan() {
                assert_eq!(encode_e4m3_fast(x), E4M3.encode(x), "e4m3 {x:e} ({b:#010x})");
                if x.abs() <= 8.0 || x.is_infinite() {
                    assert_eq!(encode_e2m1_fast(x), E2M1.encode(x), "e2m1 {x:e}");
                }
                n += 1;
            }
            b += 4093;
        }
        assert!(n > 1_000_000);
        for i in 0..=2400 {
            let x = i as f32 * 0.0025;
            for v in [x, -x, f32::from_bits(x.to_bits() + 1), f32::from_bits(x.to_bits().saturating_sub(1))] {
                assert_eq!(encode_e2m1_fast(v), E2M1.encode(v), "e2m1 {v:e}");
            }
            let y = i as f32 * 0.19;
            for v in [y, -y, y / 64.0, -y / 512.0] {
                assert_eq!(encode_e4m3_fast(v), E4M3.encode(v), "e4m3 {v:e}");
            }
        }
    }
}
