// The FMA peak of this machine's cores, the ceiling for the CPU backend's linears: every thread
// runs 12 independent chains of 512-bit fused multiply-adds on registers (no memory traffic).
// Build and run (N threads):
//   gcc -O3 -funroll-all-loops -mavx512f -mfma -pthread bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ITERS 200000000L
#define CHAINS 12

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *out) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (long it = 0; it < ITERS; it++)
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  float s = 0;
  for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_ps(acc[i]);
  *(float *)out = s;  // keeps the chains live
  return NULL;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1;
  if (n < 1 || n > 256) {
    fprintf(stderr, "usage: %s THREADS (1..256)\n", argv[0]);
    return 2;
  }
  pthread_t t[256];
  float r[256];
  double t0 = now();
  for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, run, &r[i]);
  for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
  double dt = now() - t0;
  // 16 lanes x 2 FLOP per FMA.
  printf("%d threads: %.1f GFLOP/s f32 FMA peak (checksum %g)\n", n, n * (double)ITERS * CHAINS * 32 / dt / 1e9, r[0]);
  return 0;
}
