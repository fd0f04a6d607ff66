//! A check shared by the multi-device job tests (tests/devices.rs on CPU devices,
//! tests/sim_node.rs on simulated GPUs).

use colotrain::config::JobConfig;
use colotrain::device::{bf16_rne, DType, Device};
use colotrain::model::LoadedModel;
use colotrain::train::checkpoint;
use std::path::Path;

/// After a BF16 run in `dir`: the latest checkpoint's model (the lead device's compute weights,
/// saved as f32) is exactly bf16(master) at every position, and training moved the master off
/// its BF16 start (so the equality is not that of untouched weights).
pub fn assert_compute_is_rounded_master(dir: &Path, j: &JobConfig, what: &str) {
    let ck = checkpoint::resolve(dir).unwrap();
    let master = checkpoint::load(&ck, j).unwrap().1;
    let saved = LoadedModel::load(&ck, &Device::cpu(1).unwrap(), DType::F32).unwrap();
    let compute: Vec<f32> = saved.weights.tensors().iter().flat_map(|t| t.to_f32_vec().unwrap()).collect();
    assert_eq!(compute.len(), master.len(), "{what}");
    let bad = compute.iter().zip(&master).position(|(c, m)| c.to_bits() != bf16_rne(*m).to_f32().to_bits());
    assert_eq!(bad, None, "{what}: a compute weight differs from bf16(master)");
    assert!(master.iter().any(|m| bf16_rne(*m).to_f32() != *m), "{what}: training moved the weights");
}
