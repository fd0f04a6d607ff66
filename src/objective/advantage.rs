//! Advantages from rewards: GRPO's group normalization A_i = (r_i − mean)/(std + 1e-6) over the
//! n samples of a prompt (sample std with n − 1, as verl does; population std selectable),
//! REINFORCE's raw reward, and the constant offset b added to every advantage (seed 000 App. B.1).

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Estimator {
    /// Group-normalized (GRPO).
    Grpo { population_std: bool },
    /// The raw reward (REINFORCE).
    Reinforce,
}

/// One advantage per response. `groups[i]` is response i's group (prompt); `rewards[i]` its
/// reward. Errors on a group of one under GRPO (its std is undefined).
pub fn advantages(rewards: &[f64], groups: &[u64], est: Estimator, offset: f64) -> Result<Vec<f64>> {
    if rewards.len() != groups.len() {
        bail!("advantages: {} rewards for {} responses", rewards.len(), groups.len());
    }
    let mut out = vec![0.0; rewards.len()];
    match est {
        Estimator::Reinforce => {
            for (o, r) in out.iter_mut().zip(rewards) {
                *o = *r;
            }
        }
        Estimator::Grpo { population_std } => {
            let mut members: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
            for (i, g) in groups.iter().enumerate() {
                members.entry(*g).or_default().push(i);
            }
            for (g, idx) in members {
                let n = idx.len();
                if n < 2 {
                    bail!("group {g} has a single response: GRPO's group standard deviation is undefined (sample at least 2 responses per prompt, or use REINFORCE)");
                }
                let mean = idx.iter().map(|&i| rewards[i]).sum::<f64>() / n as f64;
                let ss = idx.iter().map(|&i| (rewards[i] - mean).powi(2)).sum::<f64>();
                let std = (ss / if population_std { n as f64 } else { (n - 1) as f64 }).sqrt();
                for &i in &idx {
                    out[i] = (rewards[i] - mean) / (std + 1e-6);
                }
            }
        }
    }
    for o in &mut out {
        *o += offset;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_normalization_by_hand() {
        // Group 0: rewards 1, 0, 0, 1 → mean 0.5, sample std √(1/3), population std 0.5.
        let r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let g = [0, 0, 0, 0, 7, 7];
        let a = advantages(&r, &g, Estimator::Grpo { population_std: false }, 0.0).unwrap();
        let s = (1.0f64 / 3.0).sqrt();
        assert!((a[0] - 0.5 / (s + 1e-6)).abs() < 1e-12 && (a[1] + 0.5 / (s + 1e-6)).abs() < 1e-12);
        // An all-equal group: zero advantages (std 0, the 1e-6 keeps it finite).
        assert_eq!((a[4], a[5]), (0.0, 0.0));
        let p = advantages(&r, &g, Estimator::Grpo { population_std: true }, 0.0).unwrap();
        assert!((p[0] - 0.5 / (0.5 + 1e-6)).abs() < 1e-12);
        let b = advantages(&r, &g, Estimator::Reinforce, 0.15).unwrap();
        assert_eq!(b, vec![1.15, 0.15, 0.15, 1.15, 1.15, 1.15]);
        let e =
            advantages(&[1.0, 0.0], &[0, 1], Estimator::Grpo { population_std: false }, 0.0).unwrap_err().to_string();
        assert!(e.contains("single response"), "{e}");
    }
}
