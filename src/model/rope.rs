//! Rotary position embedding frequencies (HF `rotate_half` convention), with `linear` and
//! `llama3` scaling, computed in f32 the way transformers computes them.
//!
//! Owns: the inverse frequencies. The per-token cos/sin tables and the rotation are ops
//! (`crate::ops::rope`).

use super::config::{Rope, RopeScaling};

/// The D/2 inverse frequencies of a head of dimension `head_dim`.
pub fn inv_freq(rope: &Rope, head_dim: usize) -> Vec<f32> {
    let base = rope.theta as f32;
    let d = head_dim as f32;
    let raw: Vec<f32> = (0..head_dim / 2).map(|i| 1.0f32 / base.powf((2 * i) as f32 / d)).collect();
    match &rope.scaling {
        RopeScaling::None => raw,
        RopeScaling::Linear { factor } => raw.iter().map(|f| f / *factor as f32).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old = *original_max_position_embeddings;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            raw.iter()
                .map(|&f| {
                    let f = f as f64;
                    let wavelen = std::f64::consts::TAU / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                    } else {
                        scaled as f32
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies() {
        let r = Rope { theta: 10000.0, scaling: RopeScaling::None };
        let f = inv_freq(&r, 8);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(want) {
            assert!((*a as f64 - b).abs() <= 1e-7 + 1e-6 * b, "{a} vs {b}");
        }
    }

    #[test]
    fn llama3_scaling_regions() {
        // original 32, low 1, high 4: wavelengths > 32 are divided by 8, < 8 kept, between
        // 8 and 32 interpolated (f64 reference computed here by hand from the formula).
        let r = Rope {
            theta: 10000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 32.0,
            },
        };
        let plain = inv_freq(&Rope { theta: 10000.0, scaling: RopeScaling::None }, 16);
        let f = inv_freq(&r, 16);
        for (p, s) in plain.iter().zip(&f) {
            let w = std::f64::consts::TAU / *p as f64;
            let want = if w < 8.0 {
                *p as f64
            } else if w > 32.0 {
                *p as f64 / 8.0
            } else {
                let sm = (32.0 / w - 1.0) / 3.0;
                (1.0 - sm) * *p as f64 / 8.0 + sm * *p as f64
            };
            assert!((*s as f64 - want).abs() <= 1e-9 + 1e-6 * want, "{s} vs {want}");
        }
        assert!(f[0] == plain[0]); // highest frequency untouched
        assert!(f[7] < plain[7]); // lowest frequency scaled
    }
}
