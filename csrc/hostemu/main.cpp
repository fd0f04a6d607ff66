// main.cpp: runs the element-wise kernels of csrc/kernels on the host (see shim.h) over the
// inputs in the folder given as argv[1] (x.bin: f32 values, a multiple of 256; signs.bin: the
// 16 RHT signs; ids.bin: u32 row ids, some out of range; pos.bin: u32 positions) and writes
// their outputs there, for src/ops/hostemu/mod.rs to compare with
// the CPU quantizers. Build: c++ -std=c++17 -O2 -ffp-contract=off -include shim.h -Iinclude
// -I../include main.cpp (the test does this).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../kernels/attention.cu"
#include "../kernels/elementwise.cu"
#include "../kernels/norm.cu"
#include "../kernels/rope.cu"
#include "../kernels/quantize.cu"

static std::string dir;
static std::vector<uint8_t> rd(const char* name) {
  std::vector<uint8_t> v;
  FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
  if (!f) return v;
  std::fseek(f, 0, SEEK_END);
  v.resize(static_cast<size_t>(std::ftell(f)));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(v.data(), 1, v.size(), f) != v.size()) v.clear();
  std::fclose(f);
  return v;
}
static void wr(const std::string& name, const void* d, size_t n) {
  FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
  if (f) {
    std::fwrite(d, 1, n, f);
    std::fclose(f);
  }
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  dir = argv[1];
  std::vector<uint8_t> raw = rd("x.bin"), sg = rd("signs.bin");
  if (raw.empty() || raw.size() % 1024 != 0 || sg.size() != 64) return 3;
  const int64_t n = static_cast<int64_t>(raw.size() / 4);
  const float* x = reinterpret_cast<const float*>(raw.data());
  std::vector<__nv_bfloat16> xb(n);
  for (int64_t i = 0; i < n; i++) xb[i] = __float2bfloat16_rn(x[i]);
  float signs[16];
  std::memcpy(signs, sg.data(), 64);

  for (int src = 0; src < 2; src++) {  // weights as f32, then as bf16
    const void* xs = src == 0 ? static_cast<const void*>(x) : static_cast<const void*>(xb.data());
    const int dt = src == 0 ? CT_DTYPE_F32 : CT_DTYPE_BF16;
    const std::string tag = src == 0 ? "f32" : "bf16";
    uint32_t amax = 0;
    ct_amax_params ap{};
    ap.x = xs, ap.dtype = dt, ap.n = n, ap.amax_bits = &amax;
    ct_amax(ap);
    std::vector<uint8_t> codes(n);
    float scale = 0;
    ct_quant_fp8_params fp{};
    fp.x = xs, fp.dtype = dt, fp.n = n, fp.amax_bits = &amax, fp.codes = codes.data(), fp.scale_out = &scale;
    ct_quant_fp8(fp);
    wr("fp8_codes_" + tag, codes.data(), n);
    wr("fp8_scale_" + tag, &scale, 4);
    std::vector<float> deq(n);
    ct_dequant_params dq{};
    dq.codes = codes.data(), dq.format = CT_FORMAT_FP8, dq.n = n, dq.scale = scale, dq.out = deq.data(), dq.out_dtype = CT_DTYPE_F32;
    ct_dequant(dq);
    wr("fp8_deq_" + tag, deq.data(), 4 * n);
    for (int v = 0; v < 4; v++) {
      uint32_t am = 0;
      ct_amax_params a2{};
      a2.x = xs, a2.dtype = dt, a2.n = n, a2.rht = v & 1, a2.amax_bits = &am;
      std::memcpy(a2.signs, signs, 64);
      ct_amax(a2);
      std::vector<uint8_t> packed(n / 2), sc(n / 16);
      float global = 0;
      ct_quant_nvfp4_params q{};
      q.x = xs, q.dtype = dt, q.n = n, q.amax_bits = &am, q.rht = v & 1, q.stochastic = v >> 1;
      q.sr_seed = 0x1234567890abcdefull, q.packed = packed.data(), q.scales = sc.data(), q.global_out = &global;
      std::memcpy(q.signs, signs, 64);
      ct_quant_nvfp4(q);
      const std::string t = std::to_string(v) + "_" + tag;
      wr("nv_packed" + t, packed.data(), n / 2);
      wr("nv_scales" + t, sc.data(), n / 16);
      wr("nv_global" + t, &global, 4);
      std::vector<float> d(n);
      ct_dequant_params d2{};
      d2.codes = packed.data(), d2.scales = sc.data(), d2.format = CT_FORMAT_NVFP4, d2.n = n, d2.scale = global;
      d2.out = d.data(), d2.out_dtype = CT_DTYPE_F32;
      ct_dequant(d2);
      wr("nv_deq" + t, d.data(), 4 * n);
      if (src == 0) {  // activations: fake quantization with a fixed global scale
        std::vector<float> fq(n);
        q.fixed_global = 0.00321f, q.amax_bits = nullptr, q.packed = nullptr, q.scales = nullptr;
        q.global_out = nullptr, q.dequant = fq.data();
        ct_quant_nvfp4(q);
        wr("nv_fake" + std::to_string(v), fq.data(), 4 * n);
      }
    }
  }
  std::vector<float> fq(n);
  ct_quant_fp8_params ff{};
  ff.x = x, ff.dtype = CT_DTYPE_F32, ff.n = n, ff.fixed_scale = 0.0123f, ff.dequant = fq.data();
  ct_quant_fp8(ff);
  wr("fp8_fake", fq.data(), 4 * n);
  // KV cache writes: one token of n / 64 heads of 64 values into a one-slot cache.
  for (int c = 0; c < 2; c++) {
    std::vector<uint8_t> kc(2 * n), vc(2 * n);
    uint32_t slot = 0, err = 0;
    ct_kv_write_params k{};
    k.k = x, k.v = x, k.k_cache = kc.data(), k.v_cache = vc.data(), k.dtype = c == 0 ? CT_DTYPE_U8 : CT_DTYPE_BF16;
    k.k_scale = 0.07f, k.v_scale = 0.07f, k.slots = &slot, k.tokens = 1, k.kv_heads = static_cast<int32_t>(n / 64);
    k.block_size = 1, k.head_dim = 64, k.num_blocks = 1, k.err = &err;
    ct_kv_write(k);
    wr(c == 0 ? "kv_fp8" : "kv_bf16", kc.data(), c == 0 ? n : 2 * n);
  }
  // RoPE over rows of one head of 64 with tables cos/sin(x) rounded to f32.
  const int64_t rows = n / 64;
  std::vector<float> xr(x, x + n), cs(rows * 32), sn(rows * 32);
  for (int64_t i = 0; i < rows * 32; i++) cs[i] = std::cos(x[i]), sn[i] = std::sin(x[i]);
  ct_rope_params r{};
  r.x = xr.data(), r.cos = cs.data(), r.sin = sn.data(), r.rows = static_cast<int32_t>(rows), r.heads = 1, r.half = 32;
  ct_rope(r);
  wr("rope", xr.data(), 4 * n);
  wr("rope_cos", cs.data(), 4 * rows * 32);
  wr("rope_sin", sn.data(), 4 * rows * 32);
  // Rows of x as a table (n / 64 rows of 64): embedding (f32 and BF16 tables), gather_rows,
  // the bias add (f32 and BF16 biases: the first 64 values), casts, swiglu, the RoPE table.
  std::vector<uint8_t> idr = rd("ids.bin"), posr = rd("pos.bin");
  if (idr.empty() || posr.empty()) return 4;
  const uint32_t* ids = reinterpret_cast<const uint32_t*>(idr.data());
  const int32_t nid = static_cast<int32_t>(idr.size() / 4), vocab = static_cast<int32_t>(n / 64);
  for (int t = 0; t < 2; t++) {
    std::vector<float> out(static_cast<size_t>(nid) * 64);
    uint32_t err = 0;
    ct_embedding_params e{};
    e.table = t == 0 ? static_cast<const void*>(x) : static_cast<const void*>(xb.data());
    e.dtype = t == 0 ? CT_DTYPE_F32 : CT_DTYPE_BF16, e.vocab = vocab, e.ids = ids, e.out = out.data();
    e.rows = nid, e.cols = 64, e.err = &err;
    ct_embedding(e);
    wr(t == 0 ? "emb_f32" : "emb_bf16", out.data(), 4 * out.size());
    wr(t == 0 ? "emb_err_f32" : "emb_err_bf16", &err, 4);
  }
  {
    std::vector<float> out(static_cast<size_t>(nid) * 64);
    uint32_t err = 0;
    ct_gather_rows_params g{};
    g.src = x, g.idx = ids, g.dst = out.data(), g.rows = nid, g.cols = 64, g.src_rows = vocab, g.err = &err;
    ct_gather_rows(g);
    wr("gather", out.data(), 4 * out.size());
    wr("gather_err", &err, 4);
  }
  for (int t = 0; t < 2; t++) {
    std::vector<float> y(x, x + n);
    ct_add_bias_params b{};
    b.y0 = y.data(), b.bias0 = t == 0 ? static_cast<const void*>(x) : static_cast<const void*>(xb.data());
    b.dtype = t == 0 ? CT_DTYPE_F32 : CT_DTYPE_BF16, b.rows = vocab, b.cols0 = 64;
    ct_add_bias(b);
    wr(t == 0 ? "bias_f32" : "bias_bf16", y.data(), 4 * n);
  }
  for (int t = 0; t < 2; t++) {
    std::vector<uint16_t> y(n);
    ct_cast_params c{};
    c.x = x, c.y = y.data(), c.dtype = t == 0 ? CT_DTYPE_BF16 : CT_DTYPE_F16, c.n = n;
    ct_cast(c);
    wr(t == 0 ? "cast_bf16" : "cast_f16", y.data(), 2 * n);
  }
  {  // F16 over a sweep of f32 bit patterns (the shim's conversion stands in for the GPU's)
    std::vector<uint8_t> sw = rd("sweep.bin");
    const int64_t ns = static_cast<int64_t>(sw.size() / 4);
    std::vector<uint16_t> y(ns);
    ct_cast_params c{};
    c.x = reinterpret_cast<const float*>(sw.data()), c.y = y.data(), c.dtype = CT_DTYPE_F16, c.n = ns;
    ct_cast(c);
    wr("cast_f16_sweep", y.data(), 2 * ns);
  }
  {
    std::vector<float> up(x, x + n), out(n);
    std::reverse(up.begin(), up.end());
    ct_swiglu_params w{};
    w.gate = x, w.up = up.data(), w.out = out.data(), w.out_dtype = CT_DTYPE_F32, w.n = n;
    ct_swiglu(w);
    wr("swiglu", out.data(), 4 * n);
  }
  {
    const uint32_t* pos = reinterpret_cast<const uint32_t*>(posr.data());
    const int32_t np = static_cast<int32_t>(posr.size() / 4), half = 32;
    std::vector<float> inv(half), cs2(static_cast<size_t>(np) * half), sn2(cs2.size());
    for (int i = 0; i < half; i++) inv[i] = std::fabs(x[200 + i]) + 1e-6f;
    ct_rope_table_params rt{};
    rt.pos = pos, rt.inv_freq = inv.data(), rt.cos = cs2.data(), rt.sin = sn2.data(), rt.rows = np, rt.half = half;
    ct_rope_table(rt);
    wr("rt_cos", cs2.data(), 4 * cs2.size());
    wr("rt_sin", sn2.data(), 4 * sn2.size());
  }
  std::printf("ok %lld\n", static_cast<long long>(n));
  return 0;
}
