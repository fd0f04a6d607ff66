//! The quantizers bit for bit against ml_dtypes (fixtures from scripts/make_fixtures.py, section
//! quant): FP8 E4M3 / E5M2 and FP4 E2M1 element encodings (ties, subnormals, saturation), the
//! NVFP4 block quantizer (codes, E4M3 block scales, global scale, dequantized values, −0), and
//! per-tensor FP8. ml_dtypes overflows E4M3 to NaN and E5M2 to inf; colotrain saturates (PTX
//! cvt.rn.satfinite): the fixtures' `sat_bits` hold that, identical to `bits` in range.

mod common;

use colotrain::device::CpuFloats;
use colotrain::quant::fp8::{E2M1, E4M3, E5M2};
use colotrain::quant::qtensor::{QFormat, QTensor};
use common::*;

fn bytes(_r: &Ref, name: &str) -> Vec<u8> {
    let f = std::fs::read(fixtures().join("quant/formats.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&f).unwrap();
    st.tensor(name).unwrap().data().to_vec()
}

fn raw(file: &str, name: &str) -> Vec<u8> {
    let f = std::fs::read(fixtures().join("quant").join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&f).unwrap();
    st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).data().to_vec()
}

#[test]
fn element_encodings_match_ml_dtypes() {
    let r = Ref::open(&fixtures().join("quant/formats.safetensors"));
    for (name, f) in [("e4m3", E4M3), ("e5m2", E5M2), ("e2m1", E2M1)] {
        let (_, x) = r.f32(&format!("{name}.x"));
        let bits = bytes(&r, &format!("{name}.bits"));
        let sat = bytes(&r, &format!("{name}.sat_bits"));
        let mut in_range = 0;
        for i in 0..x.len() {
            let got = f.encode(x[i]);
            assert_eq!(
                got,
                sat[i],
                "{name}: x = {:e} ({:#010x}): got {got:#04x}, want {:#04x}",
                x[i],
                x[i].to_bits(),
                sat[i]
            );
            if x[i].abs() <= f.max() {
                assert_eq!(got, bits[i], "{name}: in-range x = {:e} differs from ml_dtypes", x[i]);
                in_range += 1;
                // Decoding is exact for every representable value.
                assert_eq!(f.decode(got).to_bits(), f.decode(bits[i]).to_bits());
            }
        }
        assert!(in_range > 1000, "{name}: {in_range} in-range inputs");
    }
}

#[test]
fn nvfp4_blocks_match_the_reference_bit_for_bit() {
    let r = Ref::open(&fixtures().join("quant/nvfp4.safetensors"));
    for name in ["normal", "mixed", "ties", "zeros"] {
        let (shape, x) = r.f32(&format!("{name}.x"));
        let (rows, k) = (shape[0], shape[1]);
        let mut q = QTensor::alloc(QFormat::Nvfp4, rows, k, Default::default()).unwrap();
        q.requantize_cpu(CpuFloats::F32(&x), name).unwrap();
        let (_, global) = r.f32(&format!("{name}.global"));
        assert_eq!(q.scale.to_bits(), global[0].to_bits(), "{name}: global scale");
        assert_eq!(
            q.codes_bytes().unwrap(),
            raw("nvfp4.safetensors", &format!("{name}.packed")),
            "{name}: packed codes"
        );
        assert_eq!(
            q.scales_bytes().unwrap(),
            raw("nvfp4.safetensors", &format!("{name}.scales")),
            "{name}: block scales"
        );
        let (_, deq) = r.f32(&format!("{name}.deq"));
        let got = q.dequantize();
        for (i, (a, b)) in got.iter().zip(&deq).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]: {a} vs {b}");
        }
    }
}

#[test]
fn fp8_per_tensor_matches_the_reference() {
    let r = Ref::open(&fixtures().join("quant/fp8.safetensors"));
    for name in ["fp8_normal", "fp8_mixed"] {
        let (shape, x) = r.f32(&format!("{name}.x"));
        let mut q = QTensor::alloc(QFormat::Fp8, shape[0], shape[1], Default::default()).unwrap();
        q.requantize_cpu(CpuFloats::F32(&x), name).unwrap();
        let (_, scale) = r.f32(&format!("{name}.scale"));
        assert_eq!(q.scale.to_bits(), scale[0].to_bits());
        assert_eq!(q.codes_bytes().unwrap(), raw("fp8.safetensors", &format!("{name}.bits")));
        let (_, deq) = r.f32(&format!("{name}.deq"));
        for (a, b) in q.dequantize().iter().zip(&deq) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}
