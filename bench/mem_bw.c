// Streaming read bandwidth from DRAM, the ceiling for batch-1 decode (which reads every weight
// once per token): each thread sums its half of a 1 GiB f32 array with 512-bit loads, four
// passes; printed for 1 thread, then for N.
// Build and run (N threads):
//   gcc -O2 -mavx512f -pthread bench/mem_bw.c -o /tmp/mem_bw && /tmp/mem_bw 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define FLOATS (256UL << 20)
#define PASSES 4

static float *a;
static size_t per_thread;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *arg) {
  const float *b = a + (size_t)arg * per_thread;
  __m512 s = _mm512_setzero_ps();
  for (int r = 0; r < PASSES; r++)
    for (size_t i = 0; i < per_thread; i += 64) {
      s = _mm512_add_ps(s, _mm512_loadu_ps(b + i));
      s = _mm512_add_ps(s, _mm512_loadu_ps(b + i + 16));
      s = _mm512_add_ps(s, _mm512_loadu_ps(b + i + 32));
      s = _mm512_add_ps(s, _mm512_loadu_ps(b + i + 48));
    }
  float out[16];
  _mm512_storeu_ps(out, s);
  return (void *)(long)(out[0] > 0);  // keeps the sum live
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 2;
  if (n < 1 || n > 64) return 1;
  a = aligned_alloc(64, FLOATS * sizeof(float));
  if (!a) return 1;
  for (size_t i = 0; i < FLOATS; i++) a[i] = 1.0f;
  int counts[2] = {1, n};
  for (int c = 0; c < 2; c++) {
    int t = counts[c];
    per_thread = FLOATS / (size_t)n / 64 * 64;
    pthread_t th[64];
    double t0 = now();
    for (long i = 0; i < t; i++) pthread_create(&th[i], 0, run, (void *)i);
    for (int i = 0; i < t; i++) pthread_join(th[i], 0);
    double s = now() - t0;
    printf("%d thread(s): %.1f GB/s\n", t, (double)t * PASSES * per_thread * sizeof(float) / s / 1e9);
  }
  return 0;
}
