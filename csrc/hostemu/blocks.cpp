// blocks.cpp: runs the block-level kernels of csrc/kernels (block reductions, scans, sorts,
// shared memory) on the host with ct_emu::launch (see shim.h), with the launch shapes of
// src/device/cuda/kernels.rs, over inputs that src/ops/hostemu/blocks.rs writes into the
// folder argv[2]; outputs go to the same folder. Every kernel runs under the three thread orders
// of ct_emu::schedule and must give the same bytes. Modes (argv[1]):
//   sample     dims.bin (i32 rows, vocab; f32 temperature of the scoring pass), logits.bin
//              (rows, vocab) f32, params.bin (rows) ct_sample_row, targets.bin (rows) u32
//              -> tokens.bin, logprobs.bin, host_rows.bin (ct_sample + ct_sample_topk),
//                 scores.bin (ct_log_softmax_gather)
//   attention  dims.bin (i32 heads, kv_heads, head_dim, block_size, num_blocks, num_seqs,
//              max_blocks, rows, dtype; f32 scale, k_scale, v_scale; i32 decode shared bytes,
//              prefill grid.x, prefill shared bytes), q.bin, k_cache.bin,
//              v_cache.bin, block_tables.bin, q_start.bin, ctx_len.bin -> out.bin
//              (ct_paged_attention), out_prefill.bin (ct_prefill_attention), err.bin
//   rmsnorm    dims.bin (i32 rows, cols; f32 eps), x.bin, r.bin (rows, cols), w.bin (cols)
//              -> y.bin, x_out.bin (ct_rmsnorm with the residual add)
//   exp        x.bin f32 -> y.bin = ct_exp_f32(x) (common.cuh)
// Build: c++ -std=c++17 -O2 -ffp-contract=off -include shim.h -Iinclude -I../include blocks.cpp
#include <string>
#include <vector>

#include "../kernels/attention.cu"
#include "../kernels/attention_prefill.cu"
#include "../kernels/logprob.cu"
#include "../kernels/sample.cu"
#include "../kernels/norm.cu"
#include "../kernels/rope.cu"
#include "../kernels/sample_topk.cu"

static std::string dir;
static std::vector<uint8_t> rd(const char* name) {
  std::vector<uint8_t> v;
  FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
  if (!f) {
    std::fprintf(stderr, "blocks: cannot open %s/%s\n", dir.c_str(), name);
    std::exit(3);
  }
  std::fseek(f, 0, SEEK_END);
  v.resize(static_cast<size_t>(std::ftell(f)));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(v.data(), 1, v.size(), f) != v.size()) std::exit(3);
  std::fclose(f);
  return v;
}
template <class T>
static std::vector<T> rd_as(const char* name) {
  const std::vector<uint8_t> b = rd(name);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}
static void wr(const char* name, const void* d, size_t n) {
  FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
  if (!f || std::fwrite(d, 1, n, f) != n) std::exit(4);
  std::fclose(f);
}
static int32_t dim_i(const std::vector<uint8_t>& d, int i) {
  int32_t v;
  std::memcpy(&v, d.data() + 4 * i, 4);
  return v;
}
static float dim_f(const std::vector<uint8_t>& d, int i) {
  float v;
  std::memcpy(&v, d.data() + 4 * i, 4);
  return v;
}

static void append(std::vector<uint8_t>& out, const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}

// Runs `once` (launch the kernels on fresh outputs, write the files, return every output's
// bytes) under the three thread orders of ct_emu::schedule; fails unless they agree.
template <class F>
static void all_schedules(const char* what, F once) {
  std::vector<uint8_t> ref;
  for (int s = 0; s < 3; s++) {
    ct_emu::schedule = s;
    std::vector<uint8_t> got = once();
    if (s == 0) {
      ref = std::move(got);
    } else if (got != ref) {
      std::fprintf(stderr, "hostemu: %s: outputs differ between thread orders 0 and %d (a shared-memory race)\n", what, s);
      std::exit(6);
    }
  }
  ct_emu::schedule = 0;
}

static void sample() {
  const std::vector<uint8_t> d = rd("dims.bin");
  const int rows = dim_i(d, 0), vocab = dim_i(d, 1);
  const float score_t = dim_f(d, 2);
  const std::vector<float> logits = rd_as<float>("logits.bin");
  const std::vector<ct_sample_row> params = rd_as<ct_sample_row>("params.bin");
  const std::vector<uint32_t> targets = rd_as<uint32_t>("targets.bin");
  if (logits.size() != static_cast<size_t>(rows) * vocab || params.size() != static_cast<size_t>(rows)) std::exit(3);
  all_schedules("sampling", [&] {
    std::vector<uint32_t> tokens(rows, 0xDEADBEEFu), host_rows(rows, 7);
    std::vector<float> lps(rows, NAN), scores(rows, NAN);
    ct_sample_params sp{};
    sp.logits = logits.data(), sp.params = params.data(), sp.rows = rows, sp.vocab = vocab;
    sp.tokens = tokens.data(), sp.logprobs = lps.data(), sp.host_rows = host_rows.data();
    ct_emu::launch(ct_sample, rows, 1, CT_ROW_THREADS, 0, sp);
    ct_emu::launch(ct_sample_topk, rows, 1, CT_ROW_THREADS, 0, sp);
    uint32_t err = 0;
    ct_logprob_params lp{};
    lp.logits = logits.data(), lp.targets = targets.data(), lp.out = scores.data(), lp.rows = rows;
    lp.vocab = vocab, lp.temperature = score_t, lp.err = &err;
    ct_emu::launch(ct_log_softmax_gather, rows, 1, CT_ROW_THREADS, 0, lp);
    wr("tokens.bin", tokens.data(), 4 * tokens.size());
    wr("logprobs.bin", lps.data(), 4 * lps.size());
    wr("host_rows.bin", host_rows.data(), 4 * host_rows.size());
    wr("scores.bin", scores.data(), 4 * scores.size());
    std::vector<uint8_t> all;
    append(all, tokens.data(), 4 * tokens.size());
    append(all, lps.data(), 4 * lps.size());
    append(all, host_rows.data(), 4 * host_rows.size());
    append(all, scores.data(), 4 * scores.size());
    return all;
  });
}

static void attention() {
  const std::vector<uint8_t> d = rd("dims.bin");
  ct_attention_params p{};
  p.heads = dim_i(d, 0), p.kv_heads = dim_i(d, 1), p.head_dim = dim_i(d, 2), p.block_size = dim_i(d, 3);
  p.num_blocks = dim_i(d, 4), p.num_seqs = dim_i(d, 5), p.max_blocks = dim_i(d, 6);
  const int rows = dim_i(d, 7);
  p.dtype = dim_i(d, 8), p.softmax_scale = dim_f(d, 9), p.k_scale = dim_f(d, 10), p.v_scale = dim_f(d, 11);
  // Launch shapes as kernels.rs computes them (paged_attention_smem, prefill_launch).
  const size_t smem = static_cast<size_t>(dim_i(d, 12));
  const unsigned pf_grid = static_cast<unsigned>(dim_i(d, 13));
  const size_t pf_smem = static_cast<size_t>(dim_i(d, 14));
  const std::vector<float> q = rd_as<float>("q.bin");
  const std::vector<uint8_t> kc = rd("k_cache.bin"), vc = rd("v_cache.bin");
  const std::vector<uint32_t> tables = rd_as<uint32_t>("block_tables.bin"), qs = rd_as<uint32_t>("q_start.bin"),
                              ctx = rd_as<uint32_t>("ctx_len.bin");
  p.q = q.data(), p.k_cache = kc.data(), p.v_cache = vc.data(), p.block_tables = tables.data();
  p.q_start = qs.data(), p.ctx_len = ctx.data(), p.num_tokens = rows, p.splits = 1;
  all_schedules("attention", [&] {
    std::vector<float> out(static_cast<size_t>(rows) * p.heads * p.head_dim, NAN), out2(out.size(), NAN);
    uint32_t err = 0;
    ct_attention_params a = p;
    a.out = out.data(), a.out_dtype = CT_DTYPE_F32, a.err = &err;
    // kernels.rs k_paged_attention: grid (rows, kv_heads), CT_ATT_THREADS threads.
    ct_emu::launch(ct_paged_attention, rows, p.kv_heads, CT_ATT_THREADS, smem, a);
    // kernels.rs k_prefill_attention: grid (pf_grid, kv_heads), CT_PF_THREADS threads.
    a.out = out2.data();
    ct_emu::launch(ct_prefill_attention, pf_grid, p.kv_heads, CT_PF_THREADS, pf_smem, a);
    wr("out.bin", out.data(), 4 * out.size());
    wr("out_prefill.bin", out2.data(), 4 * out2.size());
    wr("err.bin", &err, 4);
    std::vector<uint8_t> all;
    append(all, out.data(), 4 * out.size());
    append(all, out2.data(), 4 * out2.size());
    append(all, &err, 4);
    return all;
  });
}

static void rmsnorm() {
  const std::vector<uint8_t> d = rd("dims.bin");
  const int rows = dim_i(d, 0), cols = dim_i(d, 1);
  const std::vector<float> x0 = rd_as<float>("x.bin");
  const std::vector<float> r = rd_as<float>("r.bin"), w = rd_as<float>("w.bin");
  all_schedules("rmsnorm", [&] {
    std::vector<float> x = x0, y(x0.size(), NAN);
    ct_rmsnorm_params p{};
    p.x = x.data(), p.r = r.data(), p.y = y.data(), p.y_dtype = CT_DTYPE_F32, p.w = w.data(), p.w_dtype = CT_DTYPE_F32;
    p.rows = rows, p.cols = cols, p.eps = dim_f(d, 2);
    ct_emu::launch(ct_rmsnorm, rows, 1, 256, 0, p);  // kernels.rs NORM_THREADS
    wr("y.bin", y.data(), 4 * y.size());
    wr("x_out.bin", x.data(), 4 * x.size());
    std::vector<uint8_t> all;
    append(all, y.data(), 4 * y.size());
    append(all, x.data(), 4 * x.size());
    return all;
  });
}

static void exp_values() {
  const std::vector<float> x = rd_as<float>("x.bin");
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i++) y[i] = ct_exp_f32(x[i]);
  wr("y.bin", y.data(), 4 * y.size());
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  dir = argv[2];
  const std::string mode = argv[1];
  if (mode == "sample") sample();
  else if (mode == "attention") attention();
  else if (mode == "rmsnorm") rmsnorm();
  else if (mode == "exp") exp_values();
  else return 2;
  std::printf("ok %s\n", mode.c_str());
  return 0;
}
