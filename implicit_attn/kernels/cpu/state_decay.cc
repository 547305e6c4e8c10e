// Fused CPU kernel for the Mamba-1 operator (StateDecayCore.dense), an XLA FFI handler.
//
// H[b,c] = (diag(l) K diag(r) + diag(d)) M, with
//   K[i,j] = sum_n q[i,n] k[j,n] prod_{t=j+1..i} exp(A[n] dt[t])   (i >= j, else 0)
// and M the banded causal conv matrix of the channel's filter w (K taps), optionally
// zeroed between different documents (seg). A rank-one scalar decay (Griffin's RG-LRU)
// is the case N = 1, q = k = 1, A = -1, dt = -log a.
//
// Every output element is written exactly once; the 16 rows of a row chunk are first formed
// in a scratch buffer (the off-diagonal blocks by a register-blocked product), then each row
// is convolved into the output. The decay uses
// the chunked factorisation of the XLA path: for i in chunk I and j in an earlier
// chunk J, prod_{t=j+1..i} = [prefix of I up to i] * [chunks strictly between] *
// [suffix of J after j], each a product of factors <= 1 (no growth, no overflow).
// Inside a chunk the decay is a running product down each column.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>
#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQ = 16;  // chunk length = one vector of 16 floats
constexpr int64_t kMaxState = 64;  // states per channel of every kernel (MAX_STATE in Python)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// The machine's own vector: 16 floats with AVX-512, 8 with AVX2. A value carried around a
// loop (an accumulator) must be one: without AVX-512 no register holds a v16, and GCC keeps
// such a v16 on the stack, moving it through general registers on every pass. Loops over a
// v16's lanes in kW-wide parts do the same arithmetic per lane.
#ifdef __AVX512F__
constexpr int64_t kW = 16;
#else
constexpr int64_t kW = 8;
#endif
typedef float vw __attribute__((vector_size(kW * 4)));

// Unaligned load, store and broadcast of a v16 (or of a vw: load<vw>, splat<vw>).
template <typename V = v16>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
// x - 0 is x for every x (x + 0 is not, for x = -0), so this is a bare broadcast.
template <typename V = v16>
inline V splat(float x) {
  return x - V{};
}

typedef int32_t vwi __attribute__((vector_size(kW * 4)));

// exp of a vector of floats (V: v16 or vw, VI its int32 vector): Cody-Waite reduction
// x = k ln2 + r, |r| <= ln2/2, and a degree-6 polynomial for exp(r) (the Cephes expf
// coefficients): about 1 ulp. Results below FLT_MIN are flushed to 0, as XLA's CPU backend does.
template <typename V, typename VI>
inline V vexp_lanes(V x) {
  const V lo = splat<V>(-87.33654f), hi = splat<V>(88.3762626f);
  const V xc = x < lo ? lo : (x > hi ? hi : x);
  const V magic = splat<V>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const V kf = (xc * splat<V>(1.44269504088896341f) + magic) - magic;
  V r = xc - kf * splat<V>(0.693359375f);
  r = r - kf * splat<V>(-2.12194440e-4f);
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + splat<V>(1.3981999507e-3f);
  p = p * r + splat<V>(8.3334519073e-3f);
  p = p * r + splat<V>(4.1665795894e-2f);
  p = p * r + splat<V>(1.6666665459e-1f);
  p = p * r + splat<V>(5.0000001201e-1f);
  p = p * r * r + r + splat<V>(1.0f);
  VI bits = (__builtin_convertvector(kf, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const V y = p * scale;
  return x < lo ? splat<V>(0.0f) : (x > hi ? splat<V>(__builtin_inff()) : y);
}

// exp of 16 floats (vexp_lanes). Without AVX-512 it runs on the two kW-wide halves: GCC lowers a
// v16's comparisons and selects there far worse (a loop of v16 exponentials took 95 ns per call
// built for haswell, against 4 ns with AVX-512).
inline v16 vexp(v16 x) {
  if constexpr (kW == 16) {
    return vexp_lanes<v16, v16i>(x);
  } else {
    vw h[2];
    std::memcpy(h, &x, sizeof(x));
    h[0] = vexp_lanes<vw, vwi>(h[0]);
    h[1] = vexp_lanes<vw, vwi>(h[1]);
    std::memcpy(&x, h, sizeof(x));
    return x;
  }
}

// exp(rate * t) with exp(rate * 0) = 1 also for rate = -inf (a decay rate that overflowed):
// an empty segment decays nothing, and -inf * 0 would be NaN.
inline v16 vexp_rt(v16 rate, v16 t) { return t == splat(0.0f) ? splat(1.0f) : vexp(rate * t); }

// The reduces are tiled: blocks of kQ rows by kTile columns, whose sums, weights and
// factors stay in L1 while every channel passes over them.
constexpr int64_t kTile = 256;

// Shared by the tiled reduces (head matrices, Mamba-1): one row tile of one channel,
// s[j] += q * mode(gain * y[j]) * kw[j] for j < n (n a multiple of kQ); mode 0 as is, 1 abs,
// 2 relu.
inline void accumulate_row(float* s, const float* y, float gain, float qv, const float* kwt, int64_t n,
                           int64_t mode) {
  const v16 gv = splat(gain), q = splat(qv);
  for (int64_t J = 0; J < n; J += kQ) {
    v16 v = gv * load(y + J);
    if (mode == 1) v = v < 0.0f ? -v : v;
    if (mode == 2) v = v < 0.0f ? splat(0.0f) : v;
    store(s + J, load(s + J) + q * v * load(kwt + J));
  }
}

// The first cols entries of src into tile, the rest of it zeroed.
inline void load_tile(const float* src, int64_t cols, std::vector<float>& tile) {
  std::fill(tile.begin(), tile.end(), 0.0f);
  std::copy(src, src + cols, tile.begin());
}

// Adds rows x cols of the row-tiled sums (row stride kTile) into out (row stride L).
inline void add_tile(const float* sum, int64_t rows, int64_t cols, float* out, int64_t L) {
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* orow = out + ii * L;
    const float* s = sum + ii * kTile;
    for (int64_t j = 0; j < cols; ++j) orow[j] += s[j];
  }
}

// The conv of a row t of H (t[0] is column j0) over columns [j0, j1):
// y[j - j0] = sum_s t[j + s] w[K-1-s], written up to j1 - j0 rounded up to kW. Four vectors at a
// time: each one's sum is a chain of K dependent adds, and one chain at a time left the adder
// idle most cycles (the conv was the largest part of Mamba-1's materialize after the products);
// each element's sum keeps its order.
inline void head_conv(const float* w, int64_t K, const float* t, int64_t j0, int64_t j1,
                      float* y) {
  const int64_t n = j1 - j0;
  int64_t J = 0;
  for (; J + 4 * kW <= n; J += 4 * kW) {
    vw a0 = splat<vw>(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t s = 0; s < K; ++s) {
      const vw ws = splat<vw>(w[K - 1 - s]);
      const float* ts = t + J + s;
      a0 += ws * load<vw>(ts);
      a1 += ws * load<vw>(ts + kW);
      a2 += ws * load<vw>(ts + 2 * kW);
      a3 += ws * load<vw>(ts + 3 * kW);
    }
    store(y + J, a0);
    store(y + J + kW, a1);
    store(y + J + 2 * kW, a2);
    store(y + J + 3 * kW, a3);
  }
  for (; J < n; J += kW) {
    vw v = splat<vw>(0.0f);
    for (int64_t s = 0; s < K; ++s) v += splat<vw>(w[K - 1 - s]) * load<vw>(t + J + s);
    store(y + J, v);
  }
}

struct Dims {
  int64_t B, C, L, N, K;
};

// The inputs of one (batch, channel) operator; null pointers are absent factors.
struct Channel {
  const float *q, *k, *A, *dt, *left, *right, *diag, *w;
  const int32_t* seg;
};

// Per-channel factors (reused across channels).
struct Scratch {
  std::vector<float> Ap, dAT, qd, qp, kp, kdT;
  std::vector<double> cum;
  std::vector<int64_t> inf, bad;
  std::vector<int32_t> seg;
  explicit Scratch(const Dims& d) {
    const int64_t nc = (d.L + kQ - 1) / kQ, Lp = nc * kQ, Np = (d.N + kQ - 1) / kQ * kQ;
    Ap.resize(Np);
    dAT.resize(Lp * d.N);  // [J][n][jj]: exp(A[n] dt[J*Q + jj])
    qd.resize(Lp * d.N);   // [i][n]: q l times the decay from the chunk start through i
    qp.resize(Lp * d.N);   // [i][n]: q l
    kp.resize(Lp * d.N);   // [j][n]: k r
    kdT.resize(Lp * d.N);  // [J][n][jj]: k r times the decay after j to the chunk end
    cum.resize(nc + 1);    // finite dt summed over the chunks before J (double: differences
                           // of it give the decay between two chunks far along a sequence)
    inf.resize(nc + 1);    // chunks before J whose dt sum is +inf (a decay to 0: a restart)
    bad.resize(nc + 1);    // ... whose dt sum is NaN or -inf
    seg.resize(Lp);        // document ids, padded (-1) to whole chunks
  }
};

// The state of one row chunk I over a range of column chunks [J0, ...).
struct ChunkState {
  std::vector<float> mid, D;
  ChunkState(const Dims& d, int64_t chunks) {
    const int64_t Np = (d.N + kQ - 1) / kQ * kQ;
    mid.resize(chunks * Np);  // [J - J0][n]: decay over the chunks strictly between J and I
    D.resize(kQ * kQ);        // [ii][jj]: the diagonal block of row chunk I
  }
};

// Chunk J's running decay products for states [0, N), the decay of state n at the chunk's step jj
// at a[jj sj + n sn]: qd[(J0 + jj) N + n] = qp[(J0 + jj) N + n] times the product through step jj,
// kdT[(J N + n) kQ + jj] = kp[(J0 + jj) N + n] times the product after it to the chunk's end, and
// tot[n] (if given) the whole chunk's. kW states at a time, their products side by side (one
// state's is a chain of kQ dependent multiplies); the rest one by one, the same products in the
// same order.
void running_products(int64_t J, int64_t N, const float* a, int64_t sj, int64_t sn, const float* qp,
                      const float* kp, float* qd, float* kdT, float* tot) {
  const int64_t J0 = J * kQ;
  int64_t n0 = 0;
  for (; n0 + kW <= N; n0 += kW) {
    vw an[kQ], kd[kQ];
    for (int64_t jj = 0; jj < kQ; ++jj)
      for (int64_t l = 0; l < kW; ++l) an[jj][l] = a[jj * sj + (n0 + l) * sn];
    vw p = splat<vw>(1.0f);
    for (int64_t jj = 0; jj < kQ; ++jj) {
      p *= an[jj];
      const int64_t at = (J0 + jj) * N + n0;
      store(qd + at, load<vw>(qp + at) * p);
    }
    if (tot) store(tot + n0, p);
    p = splat<vw>(1.0f);
    for (int64_t jj = kQ - 1; jj >= 0; --jj) {
      kd[jj] = load<vw>(kp + (J0 + jj) * N + n0) * p;
      p *= an[jj];
    }
    for (int64_t l = 0; l < kW; ++l)
      for (int64_t jj = 0; jj < kQ; ++jj) kdT[(J * N + n0 + l) * kQ + jj] = kd[jj][l];
  }
  for (int64_t n = n0; n < N; ++n) {
    float p = 1.0f;
    for (int64_t jj = 0; jj < kQ; ++jj) {
      p *= a[jj * sj + n * sn];
      qd[(J0 + jj) * N + n] = qp[(J0 + jj) * N + n] * p;
    }
    if (tot) tot[n] = p;
    p = 1.0f;
    for (int64_t jj = kQ - 1; jj >= 0; --jj) {
      kdT[(J * N + n) * kQ + jj] = kp[(J0 + jj) * N + n] * p;
      p *= a[jj * sj + n * sn];
    }
  }
}

// The per-chunk factors of one channel (padding past L: dt 0, q k 0).
void prepare(const Channel& ch, const Dims& d, Scratch& s) {
  const int64_t L = d.L, N = d.N;
  const int64_t nc = (L + kQ - 1) / kQ, Np = (N + kQ - 1) / kQ * kQ;
  float *dAT = s.dAT.data(), *qd = s.qd.data(), *qp = s.qp.data(), *kp = s.kp.data(),
        *kdT = s.kdT.data();
  for (int64_t n = 0; n < Np; ++n) s.Ap[n] = n < N ? ch.A[n] : 0.0f;
  if (ch.seg)
    for (int64_t t = 0; t < nc * kQ; ++t) s.seg[t] = t < L ? ch.seg[t] : -1;
  s.cum[0] = 0.0;
  s.inf[0] = s.bad[0] = 0;
  for (int64_t J = 0; J < nc; ++J) {
    const int64_t J0 = J * kQ;
    float dtv[kQ];
    float acc = 0.0f;
    for (int64_t jj = 0; jj < kQ; ++jj) {
      dtv[jj] = J0 + jj < L ? ch.dt[J0 + jj] : 0.0f;
      acc += dtv[jj];
    }
    const bool finite = std::isfinite(acc);
    s.cum[J + 1] = s.cum[J] + (finite ? acc : 0.0f);
    s.inf[J + 1] = s.inf[J] + (acc == INFINITY);
    s.bad[J + 1] = s.bad[J] + (!finite && acc != INFINITY);
    const v16 dtj = load(dtv);
    for (int64_t n = 0; n < N; ++n) store(dAT + (J * N + n) * kQ, vexp_rt(splat(ch.A[n]), dtj));
    for (int64_t t = J0; t < J0 + kQ; ++t) {
      float* __restrict__ qo = qp + t * N;
      float* __restrict__ ko = kp + t * N;
      if (t >= L) {
        std::fill(qo, qo + N, 0.0f);
        std::fill(ko, ko + N, 0.0f);
        continue;
      }
      const float lt = ch.left ? ch.left[t] : 1.0f, rt = ch.right ? ch.right[t] : 1.0f;
      const float *qi = ch.q + t * N, *ki = ch.k + t * N;
      for (int64_t n = 0; n < N; ++n) {  // vectorised (the conditions above kept it scalar)
        qo[n] = qi[n] * lt;
        ko[n] = ki[n] * rt;
      }
    }
    running_products(J, N, dAT + J * N * kQ, 1, kQ, qp, kp, qd, kdT, nullptr);
  }
}

// The dt summed over chunks [J, I): NaN if one of them holds a NaN or -inf, +inf if one holds
// a +inf (a restart), else the difference of the double prefix sums.
inline float chunk_gap(const Scratch& s, int64_t J, int64_t I) {
  return s.bad[I] > s.bad[J]   ? NAN
         : s.inf[I] > s.inf[J] ? INFINITY
                               : static_cast<float>(s.cum[I] - s.cum[J]);
}

// The decays between chunk J and row chunk I (J < I) for J in [J0, J1) into c.mid.
void chunk_decays(int64_t I, int64_t J0, int64_t J1, const Dims& d, const Scratch& s,
                  ChunkState& c) {
  const int64_t Np = (d.N + kQ - 1) / kQ * kQ;
  for (int64_t J = J0; J < std::min(J1, I); ++J) {
    const v16 between = splat(chunk_gap(s, J + 1, I));
    for (int64_t n = 0; n < Np; n += kQ)
      store(c.mid.data() + (J - J0) * Np + n, vexp_rt(load(s.Ap.data() + n), between));
  }
}

// The diagonal block of row chunk I into c.D (row ii: columns I0..I0+15 of row I0 + ii of H
// before the conv, 0 right of the diagonal, diag added), whose decay is a running product
// down each column: G_n[jj] = k r[j, n] prod_{t=j+1..i} dA[t, n].
void diagonal_block(const Channel& ch, int64_t I, const Dims& d, const Scratch& s,
                    ChunkState& c) {
  const int64_t N = d.N, I0 = I * kQ;
  vw lane;
  for (int64_t l = 0; l < kW; ++l) lane[l] = static_cast<float>(l);
  for (int64_t h = 0; h < kQ; h += kW) {  // columns I0 + h .. I0 + h + kW - 1
    vw G[kMaxState];  // N <= kMaxState, checked by the handlers
    for (int64_t n = 0; n < N; ++n) G[n] = splat<vw>(0.0f);
    for (int64_t ii = 0; ii < kQ; ++ii) {  // rows past L have q = k = 0
      const int64_t i = I0 + ii;
      // Column j = i starts its product (a select: a store into one lane of G[n] in memory
      // stalls the vector load that follows).
      const auto start = lane == splat<vw>(static_cast<float>(ii - h));
      const auto state = [&](int64_t n, vw& sum) {
        G[n] = start ? splat<vw>(s.kp[i * N + n]) : G[n] * splat<vw>(s.dAT[(I * N + n) * kQ + ii]);
        sum += splat<vw>(s.qp[i * N + n]) * G[n];
      };
      // Four sums over the states: one was a chain of N dependent adds per row.
      vw a0 = splat<vw>(0.0f), a1 = a0, a2 = a0, a3 = a0;
      int64_t n = 0;
      for (; n + 4 <= N; n += 4) {
        state(n, a0);
        state(n + 1, a1);
        state(n + 2, a2);
        state(n + 3, a3);
      }
      for (; n < N; ++n) state(n, a0);
      vw acc = (a0 + a1) + (a2 + a3);
      // Lanes right of the diagonal hold 0 * dA products, NaN after a NaN step; the conv
      // reads them, so they must be exact zeros.
      acc = lane <= splat<vw>(static_cast<float>(ii - h)) ? acc : splat<vw>(0.0f);
      // (a select, not acc[ii - h] +=: a store into one lane and the vector load after it stall)
      if (ch.diag && i < d.L) acc = start ? acc + splat<vw>(ch.diag[i]) : acc;
      store(c.D.data() + ii * kQ + h, acc);
    }
  }
}

// t[ii * ts + jj] = sum_n q[ii * N + n] (kt[n * kQ + jj] m[n]) for the kQ rows of a chunk:
// one off-diagonal block, kRows rows at a time (their accumulators in registers) so each kt
// vector is loaded once per kRows rows.
constexpr int64_t kRows = 8;

inline void block_rows(const float* q, int64_t N, const float* kt, const float* m, float* t,
                       int64_t ts) {
  for (int64_t h = 0; h < kQ; h += kW)
    for (int64_t r0 = 0; r0 < kQ; r0 += kRows) {
      vw acc[kRows];
      for (int64_t r = 0; r < kRows; ++r) acc[r] = splat<vw>(0.0f);
      for (int64_t n = 0; n < N; ++n) {
        const vw v = load<vw>(kt + n * kQ + h) * splat<vw>(m[n]);
        for (int64_t r = 0; r < kRows; ++r) acc[r] += splat<vw>(q[(r0 + r) * N + n]) * v;
      }
      for (int64_t r = 0; r < kRows; ++r) store(t + (r0 + r) * ts + h, acc[r]);
    }
}

// The kQ rows of chunk I of H before the conv, column chunks [J0, J1), into t (row stride
// ts, t[0] is column J0 * kQ): left of the diagonal block qd diag(mid_J) kd_J^T, then D, then
// 0. Needs chunk_decays(I, J0, J1) and, if J1 > I, diagonal_block(I).
void chunk_rows(int64_t I, int64_t J0, int64_t J1, const Dims& d, const Scratch& s,
                ChunkState& c, float* t, int64_t ts) {
  const int64_t N = d.N, Np = (N + kQ - 1) / kQ * kQ;
  for (int64_t J = J0; J < J1; ++J) {
    float* tj = t + (J - J0) * kQ;
    if (J >= I) {
      for (int64_t ii = 0; ii < kQ; ++ii)
        store(tj + ii * ts, J == I ? load(c.D.data() + ii * kQ) : splat(0.0f));
      continue;
    }
    const float* kt = s.kdT.data() + J * N * kQ;
    block_rows(s.qd.data() + I * kQ * N, N, kt, c.mid.data() + (J - J0) * Np, tj, ts);
  }
}

// Packed documents: zero columns [j0, j0 + n) of row i's y outside its document (the conv
// must not reach across a document start).
inline void mask_document(const Scratch& s, int64_t i, int64_t j0, int64_t n, float* y) {
  for (int64_t J = 0; J < n; J += kQ) {
    v16i sj;
    std::memcpy(&sj, s.seg.data() + j0 + J, sizeof(sj));
    store(y + J, sj == s.seg[i] ? load(y + J) : splat(0.0f));
  }
}

// One (batch, channel) operator into out (L x L, row-major), each element written once. t
// holds kQ rows of Lp + kQ floats, y Lp floats.
void materialize_channel(const Channel& ch, const Dims& d, float* out, Scratch& s,
                         ChunkState& c, float* t, float* y) {
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ, ts = nc * kQ + kQ;
  prepare(ch, d, s);
  for (int64_t I = 0; I < nc; ++I) {
    chunk_decays(I, 0, I, d, s, c);
    diagonal_block(ch, I, d, s, c);
    chunk_rows(I, 0, I + 2, d, s, c, t, ts);  // a chunk past the diagonal: the conv reads it
    const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0), wp = I0 + kQ, width = std::min(L, wp);
    for (int64_t ii = 0; ii < rows; ++ii) {
      float* o = out + (I0 + ii) * L;
      float* dst = width == wp ? o : y;
      head_conv(ch.w, d.K, t + ii * ts, 0, wp, dst);
      if (ch.seg) mask_document(s, I0 + ii, 0, wp, dst);
      if (dst != o) std::memcpy(o, dst, sizeof(float) * width);
      if (width < L) std::memset(o + width, 0, sizeof(float) * (L - width));
    }
  }
}

// Ask for transparent huge pages on the output: faulting in a fresh output of
// hundreds of MB 4 KiB at a time costs more than computing it.
void advise_huge(void* p, size_t bytes) {
  const uintptr_t page = uintptr_t{1} << 21;
  uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
}

// A large output's rows are written with streaming stores (the dense kernels' stream attribute,
// set by cpu/__init__.py from the output's size): a plain store first reads the cache line it
// writes, which on an output larger than the caches doubles the memory traffic.

// dst[0, n) = src[0, n), with streaming stores from the first 64-byte boundary of dst on.
void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63); ++j) dst[j] = src[j];
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#elif defined(__AVX__)
  for (; j + 8 <= n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#else  // any x86-64 (a -march without AVX)
  for (; j + 4 <= n; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
#endif
  for (; j < n; ++j) dst[j] = src[j];
}

// One output row of n floats: data() is where to write it, the row itself or, where buf is given
// (a large output), buf, streamed into the row when this goes out of scope. A thread that wrote
// streamed rows calls _mm_sfence() before it finishes, so they are visible to whoever reads them.
class StreamedRow {
 public:
  StreamedRow(float* row, float* buf, int64_t n) : row_(row), buf_(buf), n_(n) {}
  StreamedRow(const StreamedRow&) = delete;
  StreamedRow& operator=(const StreamedRow&) = delete;
  ~StreamedRow() {
    if (buf_) stream_copy(row_, buf_, n_);
  }
  float* data() const { return buf_ ? buf_ : row_; }

 private:
  float* row_;
  float* buf_;
  int64_t n_;
};

// An uninitialised scratch of n floats on huge pages where Linux gives them (a fresh scratch of
// many MB otherwise pays a 4 KiB page fault, and zeroing, per page); data() is null if the
// allocation failed.
class HugeScratch {
 public:
  explicit HugeScratch(size_t n) {
    const size_t page = size_t{1} << 21, bytes = (std::max<size_t>(n, 1) * sizeof(float) + page - 1) & ~(page - 1);
    p_ = static_cast<float*>(std::aligned_alloc(page, bytes));
    if (p_) advise_huge(p_, bytes);
  }
  ~HugeScratch() { std::free(p_); }
  HugeScratch(const HugeScratch&) = delete;
  HugeScratch& operator=(const HugeScratch&) = delete;
  float* data() const { return p_; }

 private:
  float* p_;
};

// Shapes shared by both handlers; an error message, or empty.
std::string read_dims(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                      ffi::Buffer<ffi::F32>& A, ffi::Buffer<ffi::F32>& dt,
                      ffi::Buffer<ffi::F32>& w, Dims& d) {
  auto qd = q.dimensions(), kd = k.dimensions(), ad = A.dimensions(), td = dt.dimensions(),
       wd = w.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || ad.size() != 2 || td.size() != 3 || wd.size() != 2)
    return "expected q, k (B,L,N), A (C,N), dt (B,C,L), w (C,K)";
  d = Dims{qd[0], ad[0], qd[1], qd[2], wd[1]};
  if (td[0] != d.B || td[1] != d.C || td[2] != d.L || ad[1] != d.N || wd[0] != d.C ||
      kd[0] != d.B || kd[1] != d.L || kd[2] != d.N)
    return "inconsistent shapes";
  if (d.N > kMaxState || d.K > kQ) return "needs state size <= 64 and conv width <= 16";
  return "";
}

struct Factors {
  ffi::Buffer<ffi::F32> &q, &k, &A, &dt, &left, &right, &diag, &w;
  ffi::Buffer<ffi::S32>& seg;
  int64_t has_left, has_right, has_diag, has_seg;
  Channel at(const Dims& d, int64_t b, int64_t c) const {
    const size_t cl = (static_cast<size_t>(b) * d.C + c) * d.L;
    return Channel{q.typed_data() + b * d.L * d.N, k.typed_data() + b * d.L * d.N,
                   A.typed_data() + c * d.N, dt.typed_data() + cl,
                   has_left ? left.typed_data() + cl : nullptr,
                   has_right ? right.typed_data() + cl : nullptr,
                   has_diag ? diag.typed_data() + cl : nullptr, w.typed_data() + c * d.K,
                   has_seg ? seg.typed_data() + b * d.L : nullptr};
  }
};

}  // namespace

// Whether this thread has run a part for XLA's intra-op pool, i.e. is one of its workers. One
// flag for the library: a build in parts links several translation units of this file.
namespace implicit_attn_cpu {
inline thread_local bool t_pool_worker = false;
}  // namespace implicit_attn_cpu

namespace {

using implicit_attn_cpu::t_pool_worker;

// How long a caller outside the pool waits for the workers to start every part before it runs
// the parts none has started itself.
constexpr auto kPoolPatience = std::chrono::microseconds(500);

// How long a caller that is a pool worker spins for the other parts to finish before it sleeps:
// the wake-up after a sleep took 40-50 us (median, Qwen3-Next's forward on the Xeon), a spin 10-20.
constexpr auto kPoolSpin = std::chrono::microseconds(1000);

// work(t) for t = 0 .. nt-1, side by side on XLA's intra-op pool. Its workers spin a while after
// the XLA operations before the call, so a thread of our own (or a caller outside the pool)
// competed with them for the cores: at 2 ms calls on two cores, a third of the calls ran as if on
// one. A caller that is a pool worker runs part 0 and offers the rest; any other caller offers
// every part and sleeps. A part no worker has started (the caller a worker: once the caller is
// free; else after kPoolPatience) runs in the caller, claimed once by whoever comes first: a busy
// pool costs time, never a deadlock, and a late task touches only the shared claims. Without a
// pool, threads of our own.
template <typename Fn>
void run_threads(ffi::ThreadPool& xla, int64_t nt, Fn work) {
  if (nt <= 1) return work(0);
  if (xla.num_threads() <= 0) {
    std::vector<std::thread> own;
    for (int64_t t = 1; t < nt; ++t) own.emplace_back(work, t);
    work(0);
    for (auto& th : own) th.join();
    return;
  }
  struct Shared {
    explicit Shared(int64_t n, Fn* f) : claimed(new std::atomic<bool>[n]), fn(f) {
      for (int64_t t = 0; t < n; ++t) claimed[t] = false;
    }
    std::unique_ptr<std::atomic<bool>[]> claimed;
    Fn* fn;  // read only by a task that claimed its part: the caller waits for those
    std::mutex m;
    std::condition_variable cv;
    int64_t started = 0;
    std::atomic<int64_t> finished{0};  // changed under m, so a sleeping caller misses no change
  };
  auto s = std::make_shared<Shared>(nt, &work);
  const int64_t first = t_pool_worker ? 1 : 0;
  for (int64_t t = first; t < nt; ++t)
    xla.Schedule([s, t] {
      t_pool_worker = true;
      if (s->claimed[t].exchange(true)) return;
      {
        std::lock_guard<std::mutex> lock(s->m);
        ++s->started;
      }
      s->cv.notify_all();
      (*s->fn)(t);
      {
        std::lock_guard<std::mutex> lock(s->m);
        s->finished.fetch_add(1, std::memory_order_release);
      }
      s->cv.notify_all();
    });
  if (first == 1) {
    work(0);
  } else {
    std::unique_lock<std::mutex> lock(s->m);
    s->cv.wait_for(lock, kPoolPatience, [&] { return s->started == nt; });
  }
  int64_t by_pool = 0;
  for (int64_t t = first; t < nt; ++t) {
    if (s->claimed[t].exchange(true))
      ++by_pool;
    else
      work(t);
  }
  auto done = [&] { return s->finished.load(std::memory_order_acquire) == by_pool; };
  if (first == 1) {  // the caller holds a core of its own anyway
    const auto until = std::chrono::steady_clock::now() + kPoolSpin;
    while (!done() && std::chrono::steady_clock::now() < until) _mm_pause();
  }
  std::unique_lock<std::mutex> lock(s->m);
  s->cv.wait(lock, done);
}

ffi::Error StateDecayDenseImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> A, ffi::Buffer<ffi::F32> dt,
                               ffi::Buffer<ffi::F32> left, ffi::Buffer<ffi::F32> right,
                               ffi::Buffer<ffi::F32> diag, ffi::Buffer<ffi::F32> w,
                               ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                               int64_t has_left, int64_t has_right, int64_t has_diag,
                               int64_t has_seg, int64_t threads, int64_t huge_pages) {
  Dims d;
  std::string err = read_dims(q, k, A, dt, w, d);
  if (!err.empty()) return ffi::Error::InvalidArgument("state_decay_dense: " + err);
  if (d.L == 0 || d.C == 0 || d.B == 0) return ffi::Error::Success();
  Factors f{q, k, A, dt, left, right, diag, w, seg, has_left, has_right, has_diag, has_seg};
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(d.L) * d.L;
  if (huge_pages) advise_huge(o, LL * d.B * d.C * sizeof(float));
  const int64_t pairs = d.B * d.C;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, pairs));
  run_threads(xla, nt, [&](int64_t t0) {
    Scratch s(d);
    const int64_t nc = (d.L + kQ - 1) / kQ, Lp = nc * kQ;
    ChunkState c(d, nc);
    std::vector<float> t(kQ * (Lp + kQ)), y(Lp);
    for (int64_t p = t0; p < pairs; p += nt)
      materialize_channel(f.at(d, p / d.C, p % d.C), d, o + static_cast<size_t>(p) * LL, s, c,
                          t.data(), y.data());
  });
  return ffi::Error::Success();
}

// Products over channels (the linear reduces): kProdTile columns per step, so every channel's
// column factors fit in L2.
constexpr int64_t kProdTile = 128;
static_assert(kProdTile / kQ <= kQ, "a tile's chunk decays fit one vector");

// acc[r][v] = sum_c a[c][r] col[c][v] for R rows and V vectors of kQ, over n terms c (strides: a[c][r]
// at c ac + r ar, col[c][v] at c cc + v cv), kept in registers. Scaled: col[c][v] times sc[c scs + v svs].
// Step c < pf_lines also prefetches (into L2) the cache line at pf + 16 c.
constexpr int kVecsPerChunk = kQ / kW;  // machine vectors per vector of kQ: the sums are carried in vw

template <int V, bool Scaled, int R>
inline void product_sums(vw (&acc)[R][V * kVecsPerChunk], const float* a, int64_t ac, int64_t ar, const float* col,
                         int64_t cc, int64_t cv, int64_t n, const float* sc, int64_t scs, int64_t svs, const float* pf,
                         int64_t pf_lines) {
  constexpr int H = kVecsPerChunk;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V * H; ++v) acc[r][v] = splat<vw>(0.0f);
  for (int64_t c = 0; c < n; ++c) {
    if (c < pf_lines) __builtin_prefetch(pf + c * 16, 0, 2);
    vw cvec[V * H];
#pragma GCC unroll 4
    for (int v = 0; v < V * H; ++v) {
      cvec[v] = load<vw>(col + c * cc + v / H * cv + v % H * kW);
      if constexpr (Scaled) cvec[v] *= splat<vw>(sc[c * scs + v / H * svs]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vw x = splat<vw>(a[c * ac + r * ar]);
#pragma GCC unroll 4
      for (int v = 0; v < V * H; ++v) acc[r][v] += x * cvec[v];
    }
  }
}

// out[r][v] (row stride os) = product_sums: the products over channels of the linear reduces, and the
// attention logits (c: the head dimension). Scaled by sc[c scs + v] (RWKV-4's chunk-pair factors);
// prefetching the next expert's weights in the grouped products.
template <int V, bool Scaled = false, int R = 8>
inline void product8(const float* a, int64_t ac, int64_t ar, const float* col, int64_t cc, int64_t cv, int64_t n,
                     float* out, int64_t os, const float* sc = nullptr, int64_t scs = 0,
                     const float* pf = nullptr, int64_t pf_lines = 0) {
  constexpr int H = kVecsPerChunk;
  vw acc[R][V * H];
  product_sums<V, Scaled, R>(acc, a, ac, ar, col, cc, cv, n, sc, scs, 1, pf, pf_lines);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V * H; ++v) store(out + r * os + v / H * kQ + v % H * kW, acc[r][v]);
}

// out (16 rows of kQ, row stride os) = product8<1> over a's 16 rows (row r at a + r ar), in blocks
// of 6, 6 and 4 rows: without AVX-512, 8 rows of 2 machine vectors of sums, beside the column
// vectors and a broadcast, spilled the 16 registers.
inline void rows16_product(const float* a, int64_t ac, int64_t ar, const float* col, int64_t cc, int64_t cv, int64_t n,
                           float* out, int64_t os) {
  product8<1, false, 6>(a, ac, ar, col, cc, cv, n, out, os);
  product8<1, false, 6>(a + 6 * ar, ac, ar, col, cc, cv, n, out + 6 * os, os);
  product8<1, false, 4>(a + 12 * ar, ac, ar, col, cc, cv, n, out + 12 * os, os);
}

// The linear reduce (mode 0) of a rank-one decay (N = 1, Griffin's RG-LRU) without documents,
// band by band: kBand row chunks R.. (rows from S = R kQ). Left of S the entry before the conv
// factorises, for j < S <= i,
//   qp[i] decay(j+1..i) kp[j] = [qp[i] decay(S..i)] [kp[j] decay(j+1..S-1)],
// both factors <= 1 times bounded values (every decay is <= 1): neither overflows, and one
// underflows only where the product is below float's normal range anyway. Each row before the
// conv is split at S; the conv of its left part is a product over channels, rows (band x C)
// times columns (C x S) (product8), whose column factors are the conv of kp decay(j+1..S-1)
// (zero from S on) times kw: for column chunk J <= R-2 that is full (band_columns) times the decay
// over chunks J+2..R-1, for J = R-1 trunc. A tile of kProdTile columns whose chunks end at T - 2
// <= R - 2 takes them as tiled (decays to chunk T), the decay over chunks T..R-1 moved into the
// row factors, so the product reads them in place. The conv of the right part (the band's own
// chunks up to the diagonal) is formed element by element and reaches back to columns S-K+1
// (from S - kQ here). The decays between chunks come from chunk_gap, as in chunk_decays
// (restarts, NaN).
constexpr int64_t kBand = 2;  // row chunks per band (measured: 1, 2, 4 and 8)

// One channel's column factors for scalar_band, chunk by chunk (Lp floats each, 0 past L): for j
// in chunk J, full[j] = kw[j] sum_s w[K-1-s] kp[j+s] decay(j+s+1 .. end of chunk J+1) (0 for the
// last chunk), and trunc[j] the same with the conv cut at the end of chunk J and the decay to it;
// tiled[j] = full[j] decay(chunks J+2 .. T-1), T the chunk after the next tile (if T < nc).
constexpr int64_t kTileChunks = kProdTile / kQ;

void band_columns(const Channel& ch, const Dims& d, const Scratch& s, const float* kw, float* full,
                  float* trunc, float* tiled) {
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ, K = d.K;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  float last[2 * kQ] = {}, kwc[kQ] = {}, gap[kQ];
  std::copy(s.kdT.data() + (nc - 1) * kQ, s.kdT.data() + nc * kQ, last);  // the last chunk, 0 after it
  v16 e = {};
  for (int64_t J = 0; J < nc; ++J) {
    const int64_t J0 = J * kQ;
    if (J % kQ == 0) {  // the decays over chunks J+1 .. J+16, 16 at a time
      for (int64_t n = 0; n < kQ; ++n) gap[n] = J + n + 2 <= nc ? chunk_gap(s, J + n + 1, J + n + 2) : 0.0f;
      e = vexp_rt(splat(s.Ap[0]), load(gap));
    }
    // Tap s reads kdT[j+s]: from chunk J (lane + s < kQ) or J+1. Loaded from kdT itself, not from a
    // copy just stored (an unaligned load across fresh stores stalls).
    const float* src = J + 1 < nc ? s.kdT.data() + J0 : last;
    const v16 ej = splat(e[J % kQ]);
    v16 tr = splat(0.0f), fu = splat(0.0f);
    for (int64_t t = 0; t < K; ++t) {
      const v16 x = load(src + t), wv = splat(ch.w[K - 1 - t]);
      const auto own = lane + splat(static_cast<float>(t)) < splat(static_cast<float>(kQ));
      tr += wv * (own ? x : splat(0.0f));
      fu += wv * (own ? ej * x : x);
    }
    if (J0 + kQ > L) std::copy(kw + J0, kw + L, kwc);
    const v16 kv = J0 + kQ <= L ? load(kw + J0) : load(kwc);
    store(trunc + J0, tr * kv);
    store(full + J0, J + 1 < nc ? fu * kv : splat(0.0f));
  }
  for (int64_t T = kTileChunks + 1; T < nc; T += kTileChunks) {  // the tile of chunks J0 .. T-2
    const int64_t J0 = T - kTileChunks - 1;
    float gap[kQ] = {};
    for (int64_t J = J0; J < T - 1; ++J) gap[J - J0] = chunk_gap(s, J + 2, T);
    const v16 m = vexp_rt(splat(s.Ap[0]), load(gap));
    for (int64_t J = J0; J < T - 1; ++J) store(tiled + J * kQ, splat(m[J - J0]) * load(full + J * kQ));
  }
}

// The general reduce's column factors left of the diagonal, the conv folded in (no documents). Row i of
// chunk I >= J + 2 before the conv reads, at columns j' of chunks J and J + 1, qd[i] mid c[j'] summed over
// states, mid the decay over chunks J+2 .. I-1 and c kdT_J times chunk J+1's decay, then kdT_{J+1}: the
// conv's taps of a column of chunk J stay within these two chunks, so
//   conv[(J N + n) kQ + jj] = sum_t w[K-1-t] c_n[jj + t]   (t < K <= kQ; J + 1 < nc),
// and the row after the conv is a product over states (folded_rows). pair: (nc - 1) N 2 kQ floats.
void conv_columns(const Channel& ch, const Dims& d, const Scratch& s, float* pair, float* conv) {
  const int64_t N = d.N, nc = (d.L + kQ - 1) / kQ;
  for (int64_t J = 0; J + 1 < nc; ++J)
    for (int64_t n = 0; n < N; ++n) {
      const float* a = s.dAT.data() + ((J + 1) * N + n) * kQ;
      float tot = 1.0f;
      for (int64_t jj = 0; jj < kQ; ++jj) tot *= a[jj];
      if (s.bad[J + 2] > s.bad[J + 1]) tot = NAN;  // a NaN or -inf dt: NaN, as chunk_gap gives
      float* c = pair + (J * N + n) * 2 * kQ;
      store(c, load(s.kdT.data() + (J * N + n) * kQ) * splat(tot));
      store(c + kQ, load(s.kdT.data() + ((J + 1) * N + n) * kQ));
    }
  for (int64_t J = 0; J + 1 < nc; ++J)  // every pair stored before any is read (no store forwarding)
    for (int64_t n = 0; n < N; ++n) {
      const float* c = pair + (J * N + n) * 2 * kQ;
      v16 y = splat(0.0f);
      for (int64_t t = 0; t < d.K; ++t) y += splat(ch.w[d.K - 1 - t]) * load(c + t);
      store(conv + (J * N + n) * kQ, y);
    }
}

// R rows of a row chunk against V column chunks left of the diagonal (conv_columns):
//   sum[r kTile + v kQ + jj] += qw[r] mode(y_v[r][jj]) kw[v kQ + jj],
//   y_v[r] = sum_n qd[r N + n] m[v Np + n] conv[v N kQ + n kQ ..],
// mode 0 as is, 1 abs, 2 relu (as accumulate_row). The R V sums stay in registers (product_sums) and
// the row is weighted straight from them.
template <int V, int R, int MODE>
inline void folded_rows(const float* qd, int64_t N, const float* conv, const float* m, int64_t Np, const float* qw,
                        const float* kw, float* sum) {
  constexpr int H = kVecsPerChunk;
  vw acc[R][V * H];
  product_sums<V, true, R>(acc, qd, 1, N, conv, kQ, N * kQ, N, m, 1, Np, nullptr, 0);
#pragma GCC unroll 4
  for (int v = 0; v < V * H; ++v) {
    const vw kv = load<vw>(kw + v / H * kQ + v % H * kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vw a = acc[r][v];
      if constexpr (MODE == 1) a = a < 0.0f ? -a : a;
      if constexpr (MODE == 2) a = a < 0.0f ? splat<vw>(0.0f) : a;
      float* s = sum + r * kTile + v / H * kQ + v % H * kW;
      store(s, load<vw>(s) + splat<vw>(qw[r]) * a * kv);
    }
  }
}

// folded_rows over the kQ rows of a row chunk and `chunks` column chunks (from conv, m and kw, and
// sum's column 0): with AVX-512 8 rows by 2 chunks (16 sums), else 6, 6 and 4 rows by one chunk (two
// machine vectors each: 12 sums within the 16 registers).
template <int MODE>
void folded_chunks(const float* qd, int64_t N, const float* conv, const float* m, int64_t Np, const float* qw,
                   const float* kw, int64_t chunks, float* sum) {
  const int64_t cs = N * kQ;
#ifdef __AVX512F__
  for (int64_t r0 = 0; r0 < kQ; r0 += 8) {
    int64_t v = 0;
    for (; v + 2 <= chunks; v += 2)
      folded_rows<2, 8, MODE>(qd + r0 * N, N, conv + v * cs, m + v * Np, Np, qw + r0, kw + v * kQ,
                              sum + r0 * kTile + v * kQ);
    if (v < chunks)
      folded_rows<1, 8, MODE>(qd + r0 * N, N, conv + v * cs, m + v * Np, Np, qw + r0, kw + v * kQ,
                              sum + r0 * kTile + v * kQ);
  }
#else
  for (int64_t v = 0; v < chunks; ++v) {
    const float *c = conv + v * cs, *mv = m + v * Np, *kv = kw + v * kQ;
    float* sv = sum + v * kQ;
    folded_rows<1, 6, MODE>(qd, N, c, mv, Np, qw, kv, sv);
    folded_rows<1, 6, MODE>(qd + 6 * N, N, c, mv, Np, qw + 6, kv, sv + 6 * kTile);
    folded_rows<1, 4, MODE>(qd + 12 * N, N, c, mv, Np, qw + 12, kv, sv + 12 * kTile);
  }
#endif
}

struct BandBuffers {
  ChunkState cs;
  std::vector<float> t, y, sum, kwt, rowf, rowt, col, left;
  BandBuffers(const Dims& d, int64_t nc, int64_t cb)
      : cs(d, nc), t(kQ * (kBand + 3) * kQ), y(kTile), sum(kQ * kTile), kwt(kTile),
        rowf(cb * kBand * kQ), rowt(cb * kBand * kQ), col(cb * kProdTile), left(kBand * kQ * kProdTile) {}
};

// Band p of batch b for the block's nb channels (from c0) into ob (L x L, added to); full, trunc
// and tiled hold the block's band_columns ([c][Lp]).
void scalar_band(const Factors& f, const Dims& d, int64_t b, int64_t c0, int64_t nb, const std::vector<Scratch>& s,
                 const float* qw, const float* kw, const float* full, const float* trunc, const float* tiled,
                 int64_t p, float* ob, BandBuffers& u) {
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ, R = p * kBand, S = R * kQ, BR = kBand * kQ;
  const int64_t Iend = std::min(nc, R + kBand), front = R > 0 ? kQ : 0;  // columns S - front ..
  constexpr int64_t tw = (kBand + 3) * kQ;  // a row of t: front, chunks R..I+1, a chunk the conv reads
  std::fill(u.t.begin(), u.t.end(), 0.0f);
  std::fill(u.rowf.begin(), u.rowf.end(), 0.0f);
  for (int64_t I = R; I < Iend; ++I) {
    const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0), width = (I - R + 1) * kQ + front;
    const int64_t cols = std::min(L, I0 + kQ) - (S - front);
    std::fill(u.sum.begin(), u.sum.end(), 0.0f);
    for (int64_t c = 0; c < nb; ++c) {
      const Channel ch = f.at(d, b, c0 + c);
      const size_t cl = (static_cast<size_t>(b) * d.C + c0 + c) * L;
      load_tile(kw + cl + S - front, cols, u.kwt);
      chunk_decays(I, R, I, d, s[c], u.cs);
      diagonal_block(ch, I, d, s[c], u.cs);
      chunk_rows(I, R, I + 2, d, s[c], u.cs, u.t.data() + kQ, tw);
      const float* t0 = u.t.data() + kQ - front;
      for (int64_t ii = 0; ii < rows; ++ii) {
        head_conv(ch.w, d.K, t0 + ii * tw, 0, width, u.y.data());
        accumulate_row(u.sum.data() + ii * kTile, u.y.data(), 1.0f, qw[cl + I0 + ii], u.kwt.data(), width, 0);
      }
      if (S > 0) {  // row factors qw qp decay(S..i)
        const float g = vexp_rt(splat(s[c].Ap[0]), splat(chunk_gap(s[c], R, I)))[0];
        for (int64_t ii = 0; ii < rows; ++ii)
          u.rowf[c * BR + (I - R) * kQ + ii] = qw[cl + I0 + ii] * s[c].qd[I0 + ii] * g;
      }
    }
    add_tile(u.sum.data(), rows, cols, ob + I0 * L + S - front, L);
  }
  const int64_t brows = std::min(L, Iend * kQ) - S;
  for (int64_t j0 = 0; j0 < S; j0 += kProdTile) {
    const int64_t cols = std::min(kProdTile, S - j0), J0 = j0 / kQ;  // cols: a multiple of kQ
    const int64_t T = J0 + kTileChunks + 1;
    const float* rf = u.rowf.data();
    const float* cf = u.col.data();
    int64_t cs = kProdTile;
    if (T <= R) {  // the decay over chunks T..R-1 into the row factors, 16 channels at a time
      for (int64_t c1 = 0; c1 < nb; c1 += kQ) {
        float gap[kQ] = {};
        float A[kQ] = {};
        for (int64_t c = c1; c < std::min(nb, c1 + kQ); ++c) {
          gap[c - c1] = chunk_gap(s[c], T, R);
          A[c - c1] = s[c].Ap[0];
        }
        const v16 m = vexp_rt(load(A), load(gap));
        for (int64_t c = c1; c < std::min(nb, c1 + kQ); ++c)
          for (int64_t r = 0; r < BR; r += kQ)
            store(u.rowt.data() + c * BR + r, splat(m[c - c1]) * load(u.rowf.data() + c * BR + r));
      }
      rf = u.rowt.data();
      cf = tiled + j0;
      cs = nc * kQ;
    } else {
      for (int64_t c = 0; c < nb; ++c) {  // the tile's chunk decays (at most kQ) in one vector
        float gap[kQ] = {};
        for (int64_t J = J0; J < J0 + cols / kQ; ++J) gap[J - J0] = J + 2 <= R ? chunk_gap(s[c], J + 2, R) : 0.0f;
        const v16 mid = vexp_rt(splat(s[c].Ap[0]), load(gap));
        for (int64_t J = J0; J < J0 + cols / kQ; ++J) {
          const float* src = (J + 2 <= R ? full : trunc) + c * nc * kQ + J * kQ;
          store(u.col.data() + c * kProdTile + (J - J0) * kQ, splat(mid[J - J0]) * load(src));
        }
      }
    }
#ifdef __AVX512F__
    for (int64_t r0 = 0; r0 < BR; r0 += 8)
      for (int64_t J = 0; J < cols; J += 2 * kQ) {
        float* dst = u.left.data() + r0 * kProdTile + J;
        if (J + kQ < cols)
          product8<2>(rf + r0, BR, 1, cf + J, cs, kQ, nb, dst, kProdTile);
        else
          product8<1>(rf + r0, BR, 1, cf + J, cs, kQ, nb, dst, kProdTile);
      }
#else  // one column vector at a time, rows in blocks of 6, 6 and 4
    for (int64_t r0 = 0; r0 < BR; r0 += kQ)
      for (int64_t J = 0; J < cols; J += kQ)
        rows16_product(rf + r0, BR, 1, cf + J, cs, kQ, nb, u.left.data() + r0 * kProdTile + J, kProdTile);
#endif
    for (int64_t r = 0; r < brows; ++r) {
      float* orow = ob + (S + r) * L + j0;
      const float* lr = u.left.data() + r * kProdTile;
      for (int64_t jj = 0; jj < cols; ++jj) orow[jj] += lr[jj];
    }
  }
}

// sum_c qw[b,c,i] f(H_c[i,j]) kw[b,c,j] with f = identity (mode 0), |.| (1) or max(., 0) (2),
// into out (B, L, L): only the output is written. The factors of a block of channels are
// prepared once (threads split the channels); then for each tile of kTile columns, threads own
// interleaved row chunks, and each (chunk, tile) runs the block's channels over the tile: its
// sums and a channel's weights stay in L1, the block's factors over the tile's columns in L2
// for all the row chunks, and the output is read and written once per block. The linear reduce
// of a rank-one decay without documents goes band by band instead (scalar_band).
ffi::Error StateDecayReduceImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> A, ffi::Buffer<ffi::F32> dt,
                                ffi::Buffer<ffi::F32> left, ffi::Buffer<ffi::F32> right,
                                ffi::Buffer<ffi::F32> diag, ffi::Buffer<ffi::F32> w,
                                ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> qw,
                                ffi::Buffer<ffi::F32> kw, ffi::ResultBuffer<ffi::F32> out,
                                int64_t has_left, int64_t has_right, int64_t has_diag,
                                int64_t has_seg, int64_t threads, int64_t mode) {
  Dims d;
  std::string err = read_dims(q, k, A, dt, w, d);
  if (!err.empty()) return ffi::Error::InvalidArgument("state_decay_reduce: " + err);
  auto wd = qw.dimensions(), vd = kw.dimensions();
  if (wd.size() != 3 || vd.size() != 3 || wd[0] != d.B || wd[1] != d.C || wd[2] != d.L ||
      vd[0] != d.B || vd[1] != d.C || vd[2] != d.L)
    return ffi::Error::InvalidArgument("state_decay_reduce: weights must be (B, C, L)");
  if (mode < 0 || mode > 2) return ffi::Error::InvalidArgument("state_decay_reduce: bad mode");
  float* o = out->typed_data();
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ, Lp = nc * kQ;
  if (L == 0 || d.B == 0) return ffi::Error::Success();
  Factors f{q, k, A, dt, left, right, diag, w, seg, has_left, has_right, has_diag, has_seg};
  // Channels per block: their factors (about 6 L N floats each) within ~128 MiB, so that the
  // output's traffic per block is small next to the block's arithmetic.
  const int64_t per = 6 * Lp * std::max<int64_t>(d.N, 1) * 4;
  const int64_t cb = std::max<int64_t>(1, std::min<int64_t>({64, d.C, (128 << 20) / per}));
  const bool banded = d.N == 1 && mode == 0 && !has_seg;  // scalar_band's factorised path
  const bool folded = !banded && !has_seg;  // chunks left of I - 1 through conv_columns
  std::vector<float> full(banded ? cb * Lp : 0), trunc(full.size()), tiled(full.size());
  const int64_t fs = (nc - 1) * d.N * kQ;  // a channel's conv_columns
  std::vector<float> conv(folded ? cb * fs : 0);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, nc));
  constexpr int64_t ts = kTile + kQ;  // a tile's rows of H, and the chunk the conv reads past it
  std::vector<Scratch> s;
  for (int64_t c = 0; c < std::min(cb, d.C); ++c) s.emplace_back(d);
  for (int64_t b = 0; b < d.B; ++b) {
    float* ob = o + static_cast<size_t>(b) * L * L;
    std::memset(ob, 0, sizeof(float) * L * L);
    for (int64_t c0 = 0; c0 < d.C; c0 += cb) {
      const int64_t nb = std::min(cb, d.C - c0);
      run_threads(xla, std::min(nt, nb), [&](int64_t t0) {
        std::vector<float> pair(folded ? (nc - 1) * d.N * 2 * kQ : 0);
        for (int64_t c = t0; c < nb; c += std::min(nt, nb)) {
          prepare(f.at(d, b, c0 + c), d, s[c]);
          if (folded) conv_columns(f.at(d, b, c0 + c), d, s[c], pair.data(), conv.data() + c * fs);
          if (banded)
            band_columns(f.at(d, b, c0 + c), d, s[c], kw.typed_data() + (static_cast<size_t>(b) * d.C + c0 + c) * L,
                         full.data() + c * Lp, trunc.data() + c * Lp, tiled.data() + c * Lp);
        }
      });
      if (banded) {
        const int64_t bands = (nc + kBand - 1) / kBand, nbt = std::min(nt, bands);
        run_threads(xla, nbt, [&](int64_t t0) {
          BandBuffers u(d, nc, nb);
          for (int64_t p = t0; p < bands; p += nbt)
            scalar_band(f, d, b, c0, nb, s, qw.typed_data(), kw.typed_data(), full.data(), trunc.data(),
                        tiled.data(), p, ob, u);
        });
        continue;
      }
      run_threads(xla, nt, [&](int64_t t0) {
        ChunkState cs(d, kTile / kQ + 1);
        std::vector<float> t(kQ * ts), y(kTile), sum(kQ * kTile), kwt(kTile);
        const int64_t Np = (d.N + kQ - 1) / kQ * kQ;
        float qwr[kQ];
        for (int64_t j0 = 0; j0 < L; j0 += kTile) {
          const int64_t J0 = j0 / kQ;
          // Row chunk I belongs to thread I % nt, in every tile.
          for (int64_t I = J0 + (t0 - J0 % nt + nt) % nt; I < nc; I += nt) {
            const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
            const int64_t j1 = std::min(j0 + kTile, I0 + kQ), cols = std::min(j1, L) - j0;
            const int64_t J1 = j1 / kQ + 1;  // one chunk past the tile: the conv reads it
            // The tile's chunks [J0, Jf) through conv_columns, [Jf, J1 - 1) element by element.
            const int64_t Jf = folded ? std::max(J0, std::min(J1 - 1, I - 1)) : J0, jf = Jf * kQ;
            std::fill(sum.begin(), sum.end(), 0.0f);
            for (int64_t c = 0; c < nb; ++c) {
              const Channel ch = f.at(d, b, c0 + c);
              const size_t cl = (static_cast<size_t>(b) * d.C + c0 + c) * L;
              load_tile(kw.typed_data() + cl + j0, cols, kwt);
              if (Jf > J0) {
                for (int64_t ii = 0; ii < kQ; ++ii) qwr[ii] = ii < rows ? qw.typed_data()[cl + I0 + ii] : 0.0f;
                chunk_decays(I, J0, Jf + 1, d, s[c], cs);  // folded chunk J reads the decay after J + 1
                const float* qd = s[c].qd.data() + I0 * d.N;
                const float* cv = conv.data() + c * fs + J0 * d.N * kQ;
                const float* m = cs.mid.data() + Np;
                if (mode == 0) folded_chunks<0>(qd, d.N, cv, m, Np, qwr, kwt.data(), Jf - J0, sum.data());
                if (mode == 1) folded_chunks<1>(qd, d.N, cv, m, Np, qwr, kwt.data(), Jf - J0, sum.data());
                if (mode == 2) folded_chunks<2>(qd, d.N, cv, m, Np, qwr, kwt.data(), Jf - J0, sum.data());
              }
              if (Jf == J1 - 1) continue;
              chunk_decays(I, Jf, J1, d, s[c], cs);
              if (J1 > I) diagonal_block(ch, I, d, s[c], cs);
              chunk_rows(I, Jf, J1, d, s[c], cs, t.data(), ts);
              for (int64_t ii = 0; ii < rows; ++ii) {
                head_conv(ch.w, d.K, t.data() + ii * ts, jf, j1, y.data());
                if (ch.seg) mask_document(s[c], I0 + ii, jf, j1 - jf, y.data());
                accumulate_row(sum.data() + ii * kTile + jf - j0, y.data(), 1.0f,
                               qw.typed_data()[cl + I0 + ii], kwt.data() + jf - j0, j1 - jf, mode);
              }
            }
            add_tile(sum.data(), rows, cols, ob + I0 * L + j0, L);
          }
        }
      });
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Channels that share one matrix per head (Mamba-2's alpha_h, the gated delta rule's, DPLR's
// and mLSTM's M_h), the head matrices given (XLA computes them, once per head):
//   H_c = (diag(l_c) M_{head[c]} diag(r_c) + diag(d_c)) Conv_c,
// entries of M above the diagonal ignored. A row of H_c is formed in scratch from its head's
// row (which stays in cache for all the head's channels), then convolved.

struct HeadDims {
  int64_t B, H, n, L, K;  // batch, head matrices, channels, length, conv taps
};

struct HeadFactors {
  const float *M, *left, *right, *diag, *w;
  const int32_t* head;  // channel -> head matrix, or -1: the channel is skipped
  bool has_left, has_right, has_diag;
};

// Columns [j0, j1 + kQ) of row i of channel c's H_c before the conv into t (j0 a multiple of
// kQ): 0 past i. m is head row i of batch b.
inline void head_row(const HeadFactors& f, const HeadDims& d, int64_t b, int64_t c, int64_t i,
                     const float* m, int64_t j0, int64_t j1, float* t) {
  const size_t cl = (static_cast<size_t>(b) * d.n + c) * d.L;
  const float li = f.has_left ? f.left[cl + i] : 1.0f;
  const float* r = f.has_right ? f.right + cl : nullptr;
  const int64_t end = std::min(j1 + kQ, i + 1);
  const v16 lv = splat(li);
  int64_t j = j0;
  for (; j + kQ <= end; j += kQ) {
    v16 v = lv * load(m + j);
    if (r) v *= load(r + j);
    store(t + (j - j0), v);
  }
  if (j < end) {  // the chunk holding the diagonal: lanes past i are 0
    if (j + kQ <= d.L) {  // a whole vector is in bounds: load it and mask
      const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      v16 v = lv * load(m + j);
      if (r) v *= load(r + j);
      store(t + (j - j0), lane < splat(static_cast<float>(end - j)) ? v : splat(0.0f));
    } else {
      for (int64_t jj = 0; jj < kQ; ++jj)
        t[j - j0 + jj] = j + jj < end ? li * m[j + jj] * (r ? r[j + jj] : 1.0f) : 0.0f;
    }
    j += kQ;
  }
  for (; j < j1 + kQ; j += kQ) store(t + (j - j0), splat(0.0f));
  if (f.has_diag && i >= j0 && i < j1 + kQ) t[i - j0] += f.diag[cl + i];
}

// Channels grouped by head: (order of channels, start of each head's run in it).
void group_by_head(const HeadFactors& f, const HeadDims& d, std::vector<int64_t>& order,
                   std::vector<int64_t>& start) {
  order.clear();
  start.assign(d.H + 1, 0);
  for (int64_t c = 0; c < d.n; ++c)
    if (f.head[c] >= 0) ++start[f.head[c] + 1];
  for (int64_t h = 0; h < d.H; ++h) start[h + 1] += start[h];
  order.resize(start[d.H]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t c = 0; c < d.n; ++c)
    if (f.head[c] >= 0) order[fill[f.head[c]]++] = c;
}

std::string read_head_dims(ffi::Buffer<ffi::F32>& M, ffi::Buffer<ffi::S32>& head,
                           ffi::Buffer<ffi::F32>& w, HeadDims& d) {
  auto md = M.dimensions(), hd = head.dimensions(), wd = w.dimensions();
  if (md.size() != 4 || hd.size() != 1 || wd.size() != 2 || md[2] != md[3])
    return "expected head matrices (B,H,L,L), head map (n,), w (n,K)";
  d = HeadDims{md[0], md[1], hd[0], md[2], wd[1]};
  if (wd[0] != d.n) return "inconsistent shapes";
  if (d.K > kQ) return "needs conv width <= 16";
  for (int64_t c = 0; c < d.n; ++c)
    if (head.typed_data()[c] < -1 || head.typed_data()[c] >= d.H) return "head index out of range";
  return "";
}

std::string check_rows(ffi::Buffer<ffi::F32>& x, int64_t present, const HeadDims& d) {
  if (!present) return "";
  auto xd = x.dimensions();
  if (xd.size() != 3 || xd[0] != d.B || xd[1] != d.n || xd[2] != d.L)
    return "left, right, diag must be (B, n, L)";
  return "";
}

ffi::Error HeadMatrixDenseImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> M, ffi::Buffer<ffi::S32> head,
                               ffi::Buffer<ffi::F32> left, ffi::Buffer<ffi::F32> right,
                               ffi::Buffer<ffi::F32> diag, ffi::Buffer<ffi::F32> w,
                               ffi::ResultBuffer<ffi::F32> out, int64_t has_left,
                               int64_t has_right, int64_t has_diag, int64_t threads,
                               int64_t huge_pages, int64_t offset) {
  HeadDims d;
  std::string err = read_head_dims(M, head, w, d);
  for (auto* x : {&left, &right, &diag}) {
    if (!err.empty()) break;
    err = check_rows(*x, x == &left ? has_left : x == &right ? has_right : has_diag, d);
  }
  if (!err.empty()) return ffi::Error::InvalidArgument("head_matrix_dense: " + err);
  if (d.L == 0 || d.n == 0 || d.B == 0) return ffi::Error::Success();
  HeadFactors f{M.typed_data(), left.typed_data(), right.typed_data(), diag.typed_data(),
                w.typed_data(), head.typed_data(), has_left != 0, has_right != 0, has_diag != 0};
  for (int64_t c = 0; c < d.n; ++c)
    if (f.head[c] < 0) return ffi::Error::InvalidArgument("head_matrix_dense: a channel without a head");
  // The output may hold more channels (a ParallelCore's): ours are [offset, offset + n).
  const auto od = out->dimensions();
  if (od.size() != 4 || od[0] != d.B || od[2] != d.L || od[3] != d.L || offset < 0 ||
      offset + d.n > od[1])
    return ffi::Error::InvalidArgument("head_matrix_dense: output too small for the offset");
  const int64_t total = od[1];
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(d.L) * d.L;
  if (huge_pages) advise_huge(o, LL * d.B * total * sizeof(float));
  std::vector<int64_t> order, start;
  group_by_head(f, d, order, start);
  // Work items: (batch, head, chunk of kQ rows); the chunk's head rows stay in cache while
  // each of the head's channels writes its kQ rows (contiguous in its output).
  const int64_t nc = (d.L + kQ - 1) / kQ, items = d.B * d.H * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const int64_t Lp = nc * kQ;
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> t(Lp + 2 * kQ), y(Lp + kQ);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, h = (p / nc) % d.H, b = p / (nc * d.H);
      if (start[h] == start[h + 1]) continue;
      const int64_t I0 = I * kQ, rows = std::min(kQ, d.L - I0);
      const int64_t wp = (I + 1) * kQ, width = std::min(d.L, wp);  // columns past the chunk are 0
      for (int64_t k = start[h]; k < start[h + 1]; ++k) {
        const int64_t c = order[k];
        for (int64_t ii = 0; ii < rows; ++ii) {
          const int64_t i = I0 + ii;
          const float* m = f.M + ((static_cast<size_t>(b) * d.H + h) * d.L + i) * d.L;
          head_row(f, d, b, c, i, m, 0, wp, t.data());
          float* orow =
              o + (static_cast<size_t>(b) * total + offset + c) * LL + static_cast<size_t>(i) * d.L;
          if (width == wp) {
            head_conv(f.w + c * d.K, d.K, t.data(), 0, wp, orow);
          } else {
            head_conv(f.w + c * d.K, d.K, t.data(), 0, wp, y.data());
            std::memcpy(orow, y.data(), sizeof(float) * width);
          }
          if (width < d.L) std::memset(orow + width, 0, sizeof(float) * (d.L - width));
        }
      }
    }
  });
  return ffi::Error::Success();
}

// acc + sum_c qw[b,c,i] f(H_c[i,j]) kw[b,c,j] over the channels with a head (head[c] >= 0), f
// as in the state-decay reduce, into out (B, L, L) (aliased to acc by the caller). Tiled:
// blocks of kQ rows by kTile columns, so a block's head rows, a channel's weights over the
// tile and the block's sums stay in L1 while every channel of every head passes over them.
// The linear reduce (mode 0) through the heads: for the channels c of head h,
//   sum_c qw_c[i] H_c[i, j] kw_c[j] = sum_s M_h[i, j+s] X_s[i, j]  (j + s <= i),
//   X_s[i, j] = sum_c (qw_c l_c)[i] (r_c[j+s] w_c[K-1-s] kw_c[j]),
// one product over the head's channels per conv tap (product8, sums in registers) instead of
// forming each channel's rows. A diagonal term d_c (before the conv) adds, at (i, i-s),
//   E_s[i] = sum_c qw_c[i] d_c[i] w_c[K-1-s] kw_c[i-s],
// one value per row and tap. Work items (batch, chunk of kQ rows), kProdTile columns per step.
void head_reduce_linear(ffi::ThreadPool& xla, const HeadFactors& f, const HeadDims& d,
                        const std::vector<int64_t>& order,
                        const std::vector<int64_t>& start, const float* qw, const float* kw, const float* acc,
                        float* o, int64_t nt) {
  const int64_t L = d.L, K = d.K, nc = (L + kQ - 1) / kQ, Lp = nc * kQ, m = start[d.H];
  // Every summed channel's factors once, in head order: rows qw l (rf: [b][k][Lp]) and, per tap s,
  // columns r[j+s] w[K-1-s] kw[j] (cf: [b][k][s][Lp]), zero past L.
  std::vector<float> rf(static_cast<size_t>(d.B) * m * Lp, 0.0f), cf(static_cast<size_t>(d.B) * m * K * Lp, 0.0f);
  // The diagonal term's E_s[i] ([b][s][L]), summed over the channels in head order.
  std::vector<float> ediag(f.has_diag ? static_cast<size_t>(d.B) * K * L : 0, 0.0f);
  if (f.has_diag)
    run_threads(xla, std::min<int64_t>(nt, d.B), [&](int64_t t0) {
      for (int64_t b = t0; b < d.B; b += std::min<int64_t>(nt, d.B))
        for (int64_t k = 0; k < m; ++k) {
          const int64_t c = order[k];
          const size_t cl = (static_cast<size_t>(b) * d.n + c) * L;
          for (int64_t s = 0; s < K; ++s) {
            float* e = ediag.data() + (static_cast<size_t>(b) * K + s) * L;
            const float ws = f.w[c * K + K - 1 - s];
            for (int64_t i = s; i < L; ++i) e[i] += qw[cl + i] * f.diag[cl + i] * ws * kw[cl + i - s];
          }
        }
    });
  run_threads(xla, nt, [&](int64_t t0) {
    for (int64_t p = t0; p < d.B * m; p += nt) {
      const int64_t b = p / m, c = order[p % m];
      const size_t cl = (static_cast<size_t>(b) * d.n + c) * L;
      float* r = rf.data() + static_cast<size_t>(p) * Lp;
      for (int64_t i = 0; i < L; ++i) r[i] = qw[cl + i] * (f.has_left ? f.left[cl + i] : 1.0f);
      for (int64_t s = 0; s < K; ++s) {
        float* col = cf.data() + (static_cast<size_t>(p) * K + s) * Lp;
        const float ws = f.w[c * K + K - 1 - s];
        for (int64_t j = 0; j + s < L; ++j) col[j] = (f.has_right ? f.right[cl + j + s] : 1.0f) * ws * kw[cl + j];
      }
    }
  });
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> X(kQ * kProdTile), S(kQ * kProdTile);
    for (int64_t p = t0; p < d.B * nc; p += nt) {
      const int64_t I = p % nc, b = p / nc, I0 = I * kQ, rows = std::min(kQ, L - I0);
      float* ob = o + static_cast<size_t>(b) * L * L;
      if (o != acc)
        std::memcpy(ob + I0 * L, acc + static_cast<size_t>(b) * L * L + I0 * L, sizeof(float) * L * rows);
      for (int64_t j0 = 0; j0 < I0 + rows; j0 += kProdTile) {
        const int64_t cols = std::min(kProdTile, (I + 1) * kQ - j0);  // a multiple of kQ
        std::fill(S.begin(), S.end(), 0.0f);
        for (int64_t h = 0; h < d.H; ++h) {
          const int64_t P = start[h + 1] - start[h];
          if (P == 0) continue;
          const size_t k0 = static_cast<size_t>(b) * m + start[h];  // the head's first channel
          const float* M = f.M + (static_cast<size_t>(b) * d.H + h) * L * L;
          for (int64_t s = 0; s < K; ++s) {
#ifdef __AVX512F__
            for (int64_t r0 = 0; r0 < kQ; r0 += 8)
              for (int64_t J = 0; J < cols; J += 2 * kQ) {
                const float* a = rf.data() + k0 * Lp + I0 + r0;
                const float* col = cf.data() + (k0 * K + s) * Lp + j0 + J;
                float* x = X.data() + r0 * kProdTile + J;
                if (J + kQ < cols)
                  product8<2>(a, Lp, 1, col, K * Lp, kQ, P, x, kProdTile);
                else
                  product8<1>(a, Lp, 1, col, K * Lp, kQ, P, x, kProdTile);
              }
#else  // one column vector at a time, rows in blocks of 6, 6 and 4
            for (int64_t J = 0; J < cols; J += kQ)
              rows16_product(rf.data() + k0 * Lp + I0, Lp, 1, cf.data() + (k0 * K + s) * Lp + j0 + J, K * Lp, kQ, P,
                             X.data() + J, kProdTile);
#endif
            // S += M[i, j+s] X_s[i, j] over j + s <= i (entries of M above the diagonal are ignored)
            for (int64_t ii = 0; ii < rows; ++ii) {
              const int64_t i = I0 + ii, n = std::min(cols, i - s - j0 + 1);  // columns j <= i - s
              const float* mr = M + static_cast<size_t>(i) * L + j0 + s;
              float* srow = S.data() + ii * kProdTile;
              const float* x = X.data() + ii * kProdTile;
              int64_t J = 0;
              for (; J + kQ <= n; J += kQ) store(srow + J, load(srow + J) + load(mr + J) * load(x + J));
              for (; J < n; ++J) srow[J] += mr[J] * x[J];
            }
          }
        }
        if (f.has_diag)
          for (int64_t ii = 0; ii < rows; ++ii)
            for (int64_t s = 0; s < K; ++s) {
              const int64_t i = I0 + ii, j = i - s;
              if (j >= j0 && j < j0 + cols)
                S[ii * kProdTile + j - j0] += ediag[(static_cast<size_t>(b) * K + s) * L + i];
            }
        const int64_t w = std::min(cols, L - j0);
        for (int64_t ii = 0; ii < rows; ++ii) {
          float* orow = ob + (I0 + ii) * L + j0;
          const float* srow = S.data() + ii * kProdTile;
          for (int64_t jj = 0; jj < w; ++jj) orow[jj] += srow[jj];
        }
      }
    }
  });
}

ffi::Error HeadMatrixReduceImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> M, ffi::Buffer<ffi::S32> head,
                                ffi::Buffer<ffi::F32> left, ffi::Buffer<ffi::F32> right,
                                ffi::Buffer<ffi::F32> diag, ffi::Buffer<ffi::F32> w,
                                ffi::Buffer<ffi::F32> qw, ffi::Buffer<ffi::F32> kw,
                                ffi::Buffer<ffi::F32> acc, ffi::ResultBuffer<ffi::F32> out,
                                int64_t has_left, int64_t has_right, int64_t has_diag,
                                int64_t threads, int64_t mode) {
  HeadDims d;
  std::string err = read_head_dims(M, head, w, d);
  for (auto* x : {&left, &right, &diag, &qw, &kw}) {
    if (!err.empty()) break;
    const int64_t present = x == &left ? has_left : x == &right ? has_right : x == &diag ? has_diag : 1;
    err = check_rows(*x, present, d);
  }
  auto ad = acc.dimensions();
  if (err.empty() && (ad.size() != 3 || ad[0] != d.B || ad[1] != d.L || ad[2] != d.L))
    err = "the accumulator must be (B, L, L)";
  if (err.empty() && (mode < 0 || mode > 2)) err = "bad mode";
  if (!err.empty()) return ffi::Error::InvalidArgument("head_matrix_reduce: " + err);
  if (d.L == 0 || d.B == 0) return ffi::Error::Success();
  HeadFactors f{M.typed_data(), left.typed_data(), right.typed_data(), diag.typed_data(),
                w.typed_data(), head.typed_data(), has_left != 0, has_right != 0, has_diag != 0};
  float* o = out->typed_data();
  const float* a = acc.typed_data();
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ;
  std::vector<int64_t> order, start;
  group_by_head(f, d, order, start);
  const int64_t items = d.B * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  if (mode == 0) {
    head_reduce_linear(xla, f, d, order, start, qw.typed_data(), kw.typed_data(), a, o, nt);
    return ffi::Error::Success();
  }
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> t(kTile + 2 * kQ), y(kTile + kQ), sum(kQ * kTile), kwt(kTile);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, b = p / nc, I0 = I * kQ, rows = std::min(kQ, L - I0);
      float* ob = o + static_cast<size_t>(b) * L * L;
      if (o != a)
        std::memcpy(ob + I0 * L, a + static_cast<size_t>(b) * L * L + I0 * L,
                    sizeof(float) * L * rows);
      for (int64_t j0 = 0; j0 < I0 + rows; j0 += kTile) {
        const int64_t j1 = std::min(j0 + kTile, (I + 1) * kQ), cols = std::min(j1, L) - j0;
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t k = 0; k < start[d.H]; ++k) {
          const int64_t c = order[k], h = f.head[c];
          const size_t cl = (static_cast<size_t>(b) * d.n + c) * L;
          load_tile(kw.typed_data() + cl + j0, cols, kwt);
          for (int64_t ii = 0; ii < rows; ++ii) {
            const int64_t i = I0 + ii;
            if (i < j0) continue;
            const float* m = f.M + ((static_cast<size_t>(b) * d.H + h) * L + i) * L;
            const int64_t end = std::min(j1, (i / kQ + 1) * kQ);  // columns past i are 0
            head_row(f, d, b, c, i, m, j0, end, t.data());
            head_conv(f.w + c * d.K, d.K, t.data(), j0, end, y.data());
            accumulate_row(sum.data() + ii * kTile, y.data(), 1.0f, qw.typed_data()[cl + i],
                           kwt.data(), end - j0, mode);
          }
        }
        add_tile(sum.data(), rows, cols, ob + I0 * L + j0, L);
      }
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// RWKV-4 (RwkvCore): H_c[i, j] = gate_c[i] softmax_j(l)[i, j] with l[i, j] = k[j] + (i-1-j) w
// (j < i), u + k[i] (j = i). The row's log normaliser comes from an O(L) recurrence (in
// double), lse[i] = logaddexp(P[i], u + k[i]) with P[i+1] = logaddexp(P[i] + w, k[i]), so each
// element is one exponential, written once.

struct RwkvDims {
  int64_t B, C, L;
};

inline double logaddexp(double a, double b) {
  if (a == -INFINITY) return b;
  if (b == -INFINITY) return a;
  return a > b ? a + std::log1p(std::exp(b - a)) : b + std::log1p(std::exp(a - b));
}

// Row log normalisers of channel (b, c) into lse (L).
void rwkv_lse(const float* k, float w, float u, int64_t L, float* lse) {
  double P = -INFINITY;
  for (int64_t i = 0; i < L; ++i) {
    lse[i] = static_cast<float>(logaddexp(P, static_cast<double>(u) + k[i]));
    P = logaddexp(P + w, k[i]);
  }
}

// The machine's vector of doubles (8 with AVX-512, 4 with AVX2) and its int64 lanes.
constexpr int64_t kWd = kW / 2;
typedef double vd __attribute__((vector_size(kWd * 8)));
typedef int64_t vdl __attribute__((vector_size(kWd * 8)));

// exp of kWd doubles x <= 0 (or -inf, or NaN): Cody-Waite reduction and the degree-11 Taylor
// polynomial of exp(r), |r| <= ln2/2 (relative error ~1e-14); 0 below -708.
inline vd vexpd(vd x) {
  const vd lo = vd{} - 708.0, magic = vd{} + 6755399441055744.0;  // 1.5 * 2^52: rounds to integers
  const vd xc = x < lo ? lo : x;
  const vd kf = (xc * 1.4426950408889634 + magic) - magic;
  const vd r = (xc - kf * 0.693147180369123816490) - kf * 1.90821492927058770002e-10;
  vd p = vd{} + 1.0 / 39916800.0;
  for (double c : {1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6,
                   0.5, 1.0, 1.0})
    p = p * r + c;
  const vdl bits = (__builtin_convertvector(kf, vdl) + 1023) << 52;
  vd scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? vd{} : p * scale;
}

// rwkv_lse for n <= 8 channels at once (keys k + t * stride, outputs + t * L for channel t), each
// row's normaliser as lse = mx + log(1 / inv) (exp(x - lse) = exp(x - mx) inv: no logarithm), and
// past[I] = log sum_{j < I kQ} exp(k[j] + (I kQ - 1 - j) w), the decayed keys before chunk I
// (past + t * nc). The running sum of decayed keys is kept as m + log(s) in double: one exponential
// per step and channel, one per row for max(m, u + k) and the sum around it (in [1, L+1]). The
// channels sit in kG machine vectors (carried in registers: a wider vector would live on the stack).
void rwkv_lse8(const float* k, int64_t stride, const float* w, const float* u, int64_t n, int64_t L, float* mx,
               float* inv, float* past) {
  constexpr int64_t kG = 8 / kWd;
  const int64_t nc = (L + kQ - 1) / kQ;
  vd wv[kG], uv[kG], m[kG], sum[kG];
  for (int64_t g = 0; g < kG; ++g) {
    wv[g] = uv[g] = sum[g] = vd{};
    m[g] = vd{} - INFINITY;
  }
  for (int64_t t = 0; t < n; ++t) wv[t / kWd][t % kWd] = w[t], uv[t / kWd][t % kWd] = u[t];
  for (int64_t i = 0; i < L; ++i) {
#pragma GCC unroll 2
    for (int64_t g = 0; g < kG; ++g) {
      const int64_t t0 = g * kWd, nt = std::min(kWd, n - t0);
      vd kv{};
      for (int64_t t = 0; t < nt; ++t) kv[t] = k[(t0 + t) * stride + i];
      if (i % kQ == 0)
        for (int64_t t = 0; t < nt; ++t) past[(t0 + t) * nc + i / kQ] = static_cast<float>(m[g][t] + std::log(sum[g][t]));
      // lse = logaddexp(m + log s, u + k): one of the two exponentials is 1
      const vd top = uv[g] + kv, e = vexpd(m[g] < top ? m[g] - top : top - m[g]);
      const vd r = 1.0 / (m[g] < top ? sum[g] * e + 1.0 : sum[g] + e), M = m[g] < top ? top : m[g];
      for (int64_t t = 0; t < nt; ++t)
        mx[(t0 + t) * L + i] = static_cast<float>(M[t]), inv[(t0 + t) * L + i] = static_cast<float>(r[t]);
      // m + log s <- logaddexp(m + log s + w, k)
      const vd a = m[g] + wv[g], d = vexpd(a < kv ? a - kv : kv - a);
      sum[g] = a < kv ? sum[g] * d + 1.0 : sum[g] + d;
      m[g] = a < kv ? kv : a;
    }
  }
}

// Columns [j0, j0 + n) (n a multiple of kQ, j0 too) of row i of H_c before the gate into y:
// exp(l[i, j] - lse[i]), 0 past i. k must be readable up to j0 + n (padded).
inline void rwkv_row(const float* k, float w, float u, float lse, int64_t i, int64_t j0, int64_t n,
                     float* y) {
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16 wv = splat(w), lv = splat(lse), zero = splat(0.0f);
  for (int64_t J = 0; J < n; J += kQ) {
    const int64_t j = j0 + J;
    const v16 dist = splat(static_cast<float>(i - 1 - j)) - lane;  // i-1-j per lane
    // dist 0 (j = i-1) decays nothing, also for w = -inf.
    v16 l = load(k + j) + (dist == zero ? zero : dist * wv);
    v16 e = vexp(l - lv);
    if (j + kQ > i) {  // the diagonal chunk: u + k[i] at j = i, 0 past it
      const v16 col = splat(static_cast<float>(j)) + lane;
      const v16 ed = vexp(splat(u + k[i]) - lv);
      e = col < splat(static_cast<float>(i)) ? e : (col == splat(static_cast<float>(i)) ? ed : zero);
    }
    store(y + J, e);
  }
}

std::string read_rwkv_dims(ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& w,
                           ffi::Buffer<ffi::F32>& u, ffi::Buffer<ffi::F32>& gate, int64_t has_gate,
                           RwkvDims& d) {
  auto kd = k.dimensions(), wd = w.dimensions(), ud = u.dimensions(), gd = gate.dimensions();
  if (kd.size() != 3 || wd.size() != 1 || ud.size() != 1) return "expected k (B,C,L), w, u (C,)";
  d = RwkvDims{kd[0], kd[1], kd[2]};
  if (wd[0] != d.C || ud[0] != d.C) return "inconsistent shapes";
  if (has_gate && (gd.size() != 3 || gd[0] != d.B || gd[1] != d.C || gd[2] != d.L))
    return "gate must be (B, C, L)";
  return "";
}

ffi::Error RwkvDenseImpl(ffi::ThreadPool xla,
                         ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> u,
                         ffi::Buffer<ffi::F32> gate, ffi::ResultBuffer<ffi::F32> out,
                         int64_t has_gate, int64_t threads, int64_t huge_pages) {
  RwkvDims d;
  std::string err = read_rwkv_dims(k, w, u, gate, has_gate, d);
  if (!err.empty()) return ffi::Error::InvalidArgument("rwkv_dense: " + err);
  if (d.L == 0 || d.C == 0 || d.B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(d.L) * d.L;
  if (huge_pages) advise_huge(o, LL * d.B * d.C * sizeof(float));
  const int64_t pairs = d.B * d.C, Lp = (d.L + kQ - 1) / kQ * kQ;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, pairs));
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> kp(Lp, 0.0f), lse(d.L), y(Lp);
    for (int64_t p = t0; p < pairs; p += nt) {
      const int64_t c = p % d.C;
      const float* kc = k.typed_data() + static_cast<size_t>(p) * d.L;
      std::copy(kc, kc + d.L, kp.begin());
      const float wc = w.typed_data()[c], uc = u.typed_data()[c];
      rwkv_lse(kc, wc, uc, d.L, lse.data());
      float* oc = o + static_cast<size_t>(p) * LL;
      for (int64_t i = 0; i < d.L; ++i) {
        const int64_t wp = (i / kQ + 1) * kQ, width = std::min(d.L, wp);
        float* orow = oc + static_cast<size_t>(i) * d.L;
        float* dst = width == wp ? orow : y.data();
        rwkv_row(kp.data(), wc, uc, lse[i], i, 0, wp, dst);
        if (has_gate) {
          const v16 g = splat(gate.typed_data()[static_cast<size_t>(p) * d.L + i]);
          for (int64_t J = 0; J < wp; J += kQ) store(dst + J, g * load(dst + J));
        }
        std::memset(dst + i + 1, 0, sizeof(float) * (wp - i - 1));  // exact zeros above the diagonal (NaN rows)
        if (dst != orow) std::memcpy(orow, dst, sizeof(float) * width);
        if (width < d.L) std::memset(orow + width, 0, sizeof(float) * (d.L - width));
      }
    }
  });
  return ffi::Error::Success();
}

// Left of a row chunk's diagonal block the decayed softmax factorises: for i in chunk I (start I0)
// and j in an earlier chunk J (end E = (J+1) kQ), with P_I = past[I],
//   exp(l[i, j] - lse[i]) = exp(k[j] + (E-1-j) w - P_{J+1}) exp((I0-E) w + P_{J+1} - P_I)
//                           exp((i-I0) w + P_I - lse[i]),
// a column, a chunk-pair and a row factor, each <= 1 (each is one term, decayed, of the log-sum it
// is divided by: P_{J+1}, P_I, lse[i]), so none overflows, and none underflows where the product is a
// normal float. The column factors (times kw) and the row factors (times qw f(gate)) are formed once
// per channel, the chunk-pair factors once per (channel, row chunk, column tile) and multiplied into
// the tile's columns. As H_c >= 0 up to the gate, f(gate e) = f(gate) e for the three maps, and the
// chunk's rows left of the diagonal are a product over channels, rows (kQ x C) times columns
// (C x I0) (product8). Inside the diagonal block each entry is one exponential, two rows per vector;
// its diagonal (the bonus u) is formed with the row factors. No logarithm: exp(x - lse[i]) is
// exp(x - mx[i]) inv[i] (rwkv_lse8).
// sum_c qw[b,c,i] f(H_c[i,j]) kw[b,c,j] into out (B, L, L), f as in the other reduces.
ffi::Error RwkvReduceImpl(ffi::ThreadPool xla,
                          ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> u,
                          ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> qw,
                          ffi::Buffer<ffi::F32> kw, ffi::ResultBuffer<ffi::F32> out,
                          int64_t has_gate, int64_t threads, int64_t mode) {
  RwkvDims d;
  std::string err = read_rwkv_dims(k, w, u, gate, has_gate, d);
  auto qd = qw.dimensions(), vd = kw.dimensions();
  if (err.empty() && (qd.size() != 3 || vd.size() != 3 || qd[0] != d.B || qd[1] != d.C ||
                      qd[2] != d.L || vd[0] != d.B || vd[1] != d.C || vd[2] != d.L))
    err = "weights must be (B, C, L)";
  if (err.empty() && (mode < 0 || mode > 2)) err = "bad mode";
  if (!err.empty()) return ffi::Error::InvalidArgument("rwkv_reduce: " + err);
  const int64_t L = d.L, C = d.C, nc = (L + kQ - 1) / kQ, Lp = nc * kQ;
  if (L == 0 || d.B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, zero = splat(0.0f);
  constexpr int64_t kH = kQ / 2, kAB = kW == 16 ? kH : 2;  // pairs of diagonal-block rows per pass
  static_assert(kH % kAB == 0, "whole passes");
  vw lw, zw = splat<vw>(0.0f);
  std::memcpy(&lw, &lane, sizeof(lw));
  // Per channel and row chunk, once (O(B C L); about 9 floats per channel and position), laid out
  // chunk-major so that a row chunk's pass over the channels reads consecutive memory: a record of
  // the keys and kw of the chunk and the one before it (zeros before column 0 and past L), the rows'
  // mx and qi = qw f(gate) inv (qi 0 past L), and the diagonal's terms (times kw); the row factors
  // rowf (from chunk 1 on) the same way; the column factors colf by column tile (up to the last
  // chunk); past per channel.
  constexpr int64_t kRk = 0, kRw = 2 * kQ, kRm = 4 * kQ, kRq = 5 * kQ, kRd = 6 * kQ, kRec = 7 * kQ;
  const size_t BC = static_cast<size_t>(d.B) * C;
  const int64_t nT = (Lp + kProdTile - 1) / kProdTile;  // colf: [b][column tile][c][kProdTile]
  // Every entry read is written first (past's kQ trailing floats are read only into lanes left unused).
  HugeScratch rec_buf(BC * nc * kRec), rowf_buf(BC * nc * kQ), colf_buf(static_cast<size_t>(d.B) * nT * C * kProdTile);
  float *rec = rec_buf.data(), *rowf = rowf_buf.data(), *colf = colf_buf.data();
  if (!rec || !rowf || !colf) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "rwkv_reduce: out of memory");
  std::vector<float> past(BC * nc + kQ);
  const int64_t groups = d.B * ((C + 7) / 8);  // 8 channels of one batch at a time
  run_threads(xla, std::max<int64_t>(1, std::min<int64_t>(threads, groups)), [&](int64_t t0) {
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, groups));
    // The group's padded rows (kQ zeros before the keys and kw), then its records chunk by chunk:
    // the 8 channels' records of a chunk lie side by side.
    const int64_t Lq = kQ + Lp;
    std::vector<float> m8(8 * Lp, 0.0f), inv8(8 * L), kc(8 * Lq), kwc(8 * Lq), qc(8 * Lp);
    for (int64_t g = t0; g < groups; g += nt) {
      const int64_t b = g / ((C + 7) / 8), c0 = g % ((C + 7) / 8) * 8, n = std::min<int64_t>(8, C - c0);
      const size_t p = static_cast<size_t>(b) * C + c0;
      rwkv_lse8(k.typed_data() + p * L, L, w.typed_data() + c0, u.typed_data() + c0, n, L, m8.data(), inv8.data(),
                past.data() + p * nc);
      std::fill(kc.begin(), kc.end(), 0.0f);
      std::fill(kwc.begin(), kwc.end(), 0.0f);
      std::fill(qc.begin(), qc.end(), 0.0f);
      for (int64_t t = n - 1; t >= 0; --t) {  // m8 rows re-spaced from L to Lp, last first
        const size_t cl = (p + t) * L;
        std::copy(k.typed_data() + cl, k.typed_data() + cl + L, kc.begin() + t * Lq + kQ);
        std::copy(kw.typed_data() + cl, kw.typed_data() + cl + L, kwc.begin() + t * Lq + kQ);
        std::copy_backward(m8.begin() + t * L, m8.begin() + (t + 1) * L, m8.begin() + t * Lp + L);
        std::fill(m8.begin() + t * Lp + L, m8.begin() + (t + 1) * Lp, 0.0f);
        for (int64_t i = 0; i < L; ++i) {
          float gv = has_gate ? gate.typed_data()[cl + i] : 1.0f;
          if (mode == 1) gv = std::fabs(gv);
          if (mode == 2) gv = std::max(gv, 0.0f);
          qc[t * Lp + i] = qw.typed_data()[cl + i] * gv * inv8[t * L + i];
        }
      }
      for (int64_t I = 0; I < nc; ++I) {
        const int64_t I0 = I * kQ;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t c = c0 + t;
          const float wc = w.typed_data()[c], uc = u.typed_data()[c];
          const float *P = past.data() + (p + t) * nc, *kt = kc.data() + t * Lq, *kwt = kwc.data() + t * Lq,
                      *mt = m8.data() + t * Lp, *qt = qc.data() + t * Lp;
          float* r = rec + ((static_cast<size_t>(b) * nc + I) * C + c) * kRec;
          std::copy(kt + I0, kt + I0 + 2 * kQ, r + kRk);
          std::copy(kwt + I0, kwt + I0 + 2 * kQ, r + kRw);
          float* rw = rowf + ((static_cast<size_t>(b) * nc + I) * C + c) * kQ;
          float* cw = colf + ((static_cast<size_t>(b) * nT + I0 / kProdTile) * C + c) * kProdTile + I0 % kProdTile;
#pragma GCC unroll 2
          for (int64_t h = 0; h < kQ / kW; ++h) {  // kW-wide parts
            const int64_t o = I0 + h * kW;
            const vw ln = lw + splat<vw>(static_cast<float>(h * kW)), wv = splat<vw>(wc);
            const vw m = load<vw>(mt + o), qv = load<vw>(qt + o), kv = load<vw>(kt + kQ + o),
                     kwv = load<vw>(kwt + kQ + o);
            store(r + kRm + h * kW, m);
            store(r + kRq + h * kW, qv);
            store(r + kRd + h * kW, qv * vexp_lanes<vw, vwi>(splat<vw>(uc) + kv - m) * kwv);
            if (I > 0)  // (i - I0) w; 0 decays nothing, also for w = -inf
              store(rw + h * kW, qv * vexp_lanes<vw, vwi>((ln == zw ? zw : ln * wv) + splat<vw>(P[I]) - m));
            if (I + 1 < nc) {  // (E-1-j) w
              const vw back = splat<vw>(static_cast<float>(kQ - 1)) - ln;
              const vw x = kv + (back == zw ? zw : back * wv) - splat<vw>(P[I + 1]);
              store(cw + h * kW, vexp_lanes<vw, vwi>(x) * kwv);
            }
          }
        }
      }
    }
  });
  const int64_t items = d.B * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> diag(kQ * kQ), sv(C * kTileChunks), left(kQ * kProdTile);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, b = p / nc, I0 = I * kQ, rows = std::min(kQ, L - I0);
      float* ob = o + static_cast<size_t>(b) * L * L;
      const float* recs = rec + (static_cast<size_t>(b) * nc + I) * C * kRec;
      // The diagonal block's strictly lower entries, rows a and kQ - a in one vector of kQ (lanes
      // below a: row a, column I0 + lane; the others: row kQ - a, column I0 + lane - a; row kQ / 2
      // alone), one exponential each, in kW-wide parts; kAB pairs per pass over the channels, so
      // that their sums stay in registers. Then the diagonal.
      std::fill(diag.begin(), diag.end(), 0.0f);
      vw dsum[kQ / kW];
      for (int64_t a0 = 1; a0 <= kH; a0 += kAB) {
        vw acc[kAB][kQ / kW];
        for (auto& x : acc)
          for (auto& y : x) y = zw;
        if (a0 == 1)
          for (auto& y : dsum) y = zw;
        for (int64_t c = 0; c < C; ++c) {
          const float* r = recs + c * kRec;
          const float *kc = r + kRk + kQ, *kwc = r + kRw + kQ, *mc = r + kRm, *qc = r + kRq;
          const vw wv = splat<vw>(w.typed_data()[c]);
#pragma GCC unroll 8
          for (int64_t da = 0; da < kAB; ++da) {
            const int64_t a = a0 + da;
            const vwi ok_lo = a < rows ? ~vwi{} : vwi{}, ok_hi = a < kH && kQ - a < rows ? ~vwi{} : vwi{};
#pragma GCC unroll 2
            for (int64_t h = 0; h < kQ / kW; ++h) {
              const vw ln = lw + splat<vw>(static_cast<float>(h * kW));
              const vwi lo = ln < splat<vw>(static_cast<float>(a));
              // i-1-j: a-1-lane below a, (kQ-a)-1-(lane-a) = kQ-1-lane above; 0 decays nothing
              const vw dist = (lo ? splat<vw>(static_cast<float>(a - 1)) : splat<vw>(static_cast<float>(kQ - 1))) - ln;
              const vw m = lo ? splat<vw>(mc[a]) : splat<vw>(mc[kQ - a]);
              const vw q = lo ? splat<vw>(qc[a]) : splat<vw>(qc[kQ - a]);
              const vw x = (lo ? load<vw>(kc + h * kW) : load<vw>(kc - a + h * kW)) + (dist == zw ? zw : dist * wv) - m;
              const vw e = q * vexp_lanes<vw, vwi>(x) * (lo ? load<vw>(kwc + h * kW) : load<vw>(kwc - a + h * kW));
              acc[da][h] += (lo ? ok_lo : ok_hi) ? e : zw;
            }
          }
          if (a0 == 1)
            for (int64_t h = 0; h < kQ / kW; ++h) dsum[h] += load<vw>(r + kRd + h * kW);
        }
        for (int64_t da = 0; da < kAB; ++da) {
          const int64_t a = a0 + da;
          float v[kQ];
          for (int64_t h = 0; h < kQ / kW; ++h) store(v + h * kW, acc[da][h]);
          for (int64_t l = 0; l < kQ; ++l) {
            if (l < a) diag[a * kQ + l] = v[l];
            else if (a < kH) diag[(kQ - a) * kQ + l - a] = v[l];
          }
        }
      }
      float dv[kQ];
      for (int64_t h = 0; h < kQ / kW; ++h) store(dv + h * kW, dsum[h]);
      for (int64_t ii = 0; ii < rows; ++ii) {
        float* orow = ob + (I0 + ii) * L;
        diag[ii * kQ + ii] += dv[ii];
        std::copy(diag.data() + ii * kQ, diag.data() + ii * kQ + std::min(kQ, L - I0), orow + I0);
        if (I0 + kQ < L) std::memset(orow + I0 + kQ, 0, sizeof(float) * (L - I0 - kQ));
      }
      // Left of the diagonal block: kProdTile columns at a time, every channel's chunk-pair factors
      // exp((I0-E) w + P_{J+1} - P_I) (one vector: a tile's chunks), then the product over channels
      // of the row factors and the column factors scaled by them.
      const float* rf = rowf + (static_cast<size_t>(b) * nc + I) * C * kQ;
      for (int64_t j0 = 0; j0 < I0; j0 += kProdTile) {
        const int64_t cols = std::min(kProdTile, I0 - j0);  // a multiple of kQ
        const v16 gap = splat(static_cast<float>(I0 - j0 - kQ)) - lane * splat(static_cast<float>(kQ));  // I0 - E
        for (int64_t c = 0; c < C; ++c) {
          const float* P = past.data() + (static_cast<size_t>(b) * C + c) * nc;
          // P_{J+1} per lane (chunk J = j0 / kQ + lane; lanes past the tile's chunks unused)
          const v16 x = (gap == zero ? zero : gap * splat(w.typed_data()[c])) + load(P + j0 / kQ + 1) - splat(P[I]);
          const v16 s = vexp(x);
          std::memcpy(sv.data() + c * kTileChunks, &s, sizeof(float) * kTileChunks);
        }
        const float* cf = colf + (static_cast<size_t>(b) * nT + j0 / kProdTile) * C * kProdTile;
        if constexpr (kW == 16) {
          for (int64_t r0 = 0; r0 < kQ; r0 += 8)
            for (int64_t J = 0; J < cols; J += 2 * kQ) {
              float* dst = left.data() + r0 * kProdTile + J;
              if (J + kQ < cols)
                product8<2, true>(rf + r0, kQ, 1, cf + J, kProdTile, kQ, C, dst, kProdTile, sv.data() + J / kQ,
                                  kTileChunks);
              else
                product8<1, true>(rf + r0, kQ, 1, cf + J, kProdTile, kQ, C, dst, kProdTile, sv.data() + J / kQ,
                                  kTileChunks);
            }
        } else {  // 4 rows by one vector: the sums fit AVX2's 16 registers
          for (int64_t r0 = 0; r0 < kQ; r0 += 4)
            for (int64_t J = 0; J < cols; J += kQ)
              product8<1, true, 4>(rf + r0, kQ, 1, cf + J, kProdTile, kQ, C, left.data() + r0 * kProdTile + J,
                                   kProdTile, sv.data() + J / kQ, kTileChunks);
        }
        for (int64_t ii = 0; ii < rows; ++ii)
          std::copy(left.data() + ii * kProdTile, left.data() + ii * kProdTile + cols, ob + (I0 + ii) * L + j0);
      }
    }
  });
  return ffi::Error::Success();
}

// LFM2's gated short conv (ShortConvCore): H_c[i, j] = left[i] w[K-1-(i-j)] right[j] on the band
// 0 <= i-j < K, exact zeros elsewhere; each row written once.
ffi::Error ShortConvDenseImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> left,
                              ffi::Buffer<ffi::F32> right, ffi::ResultBuffer<ffi::F32> out,
                              int64_t has_right, int64_t threads, int64_t huge_pages) {
  auto wd = w.dimensions(), ld = left.dimensions(), rd = right.dimensions();
  if (wd.size() != 2 || ld.size() != 3 || ld[1] != wd[0] ||
      (has_right && (rd.size() != 3 || rd[0] != ld[0] || rd[1] != ld[1] || rd[2] != ld[2])))
    return ffi::Error::InvalidArgument("short_conv_dense: expected w (C,K), left, right (B,C,L)");
  const int64_t B = ld[0], C = ld[1], L = ld[2], K = wd[1];
  if (L == 0 || C == 0 || B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(L) * L;
  if (huge_pages) advise_huge(o, LL * B * C * sizeof(float));
  const int64_t pairs = B * C;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, pairs));
  run_threads(xla, nt, [&](int64_t t0) {
    for (int64_t p = t0; p < pairs; p += nt) {
      const int64_t c = p % C;
      const float* l = left.typed_data() + static_cast<size_t>(p) * L;
      const float* r = has_right ? right.typed_data() + static_cast<size_t>(p) * L : nullptr;
      const float* wc = w.typed_data() + c * K;
      float* oc = o + static_cast<size_t>(p) * LL;
      for (int64_t i = 0; i < L; ++i) {
        float* orow = oc + static_cast<size_t>(i) * L;
        std::memset(orow, 0, sizeof(float) * L);
        for (int64_t s = 0; s < K && s <= i; ++s)
          orow[i - s] = l[i] * wc[K - 1 - s] * (r ? r[i - s] : 1.0f);
      }
    }
  });
  return ffi::Error::Success();
}

// Softmax attention probabilities (AttentionCore): P_h[i, j] = softmax_j(q_h[i] . k_g[j]) over the
// visible keys j <= i, i - j < window, seg[j] == seg[i] (g = kv[h]), exact zeros elsewhere. Work
// items are (batch, head, chunk of kQ rows): the chunk's logits are formed block by block (kQ rows
// times one vector of keys, the kQ accumulators in registers; only blocks the window reaches), then
// each row is max-shifted, exponentiated, normalised and written once.
// Keys once per (batch, key head) in blocks of kQ columns, [block][e][column], zero past L: the
// attention kernels' column operand.
std::unique_ptr<float[]> keys_by_block(ffi::ThreadPool& xla, int64_t threads, const float* k, int64_t BKV, int64_t L,
                                       int64_t D) {
  const int64_t nc = (L + kQ - 1) / kQ, blocks = BKV * nc;
  std::unique_ptr<float[]> kT(new float[static_cast<size_t>(blocks) * D * kQ]);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  run_threads(xla, nt, [&](int64_t t0) {  // in threads: serial, it took a tenth of LaS materialize's samples
    for (int64_t blk = t0; blk < blocks; blk += nt) {
      const int64_t rows = std::min(kQ, L - blk % nc * kQ);
      const float* src = k + (static_cast<size_t>(blk / nc) * L + blk % nc * kQ) * D;
      float* dst = kT.get() + static_cast<size_t>(blk) * D * kQ;
      for (int64_t jj = 0; jj < rows; ++jj)
        for (int64_t e = 0; e < D; ++e) dst[e * kQ + jj] = src[jj * D + e];
      for (int64_t jj = rows; jj < kQ; ++jj)
        for (int64_t e = 0; e < D; ++e) dst[e * kQ + jj] = 0.0f;
    }
  });
  return kT;
}

// One chunk of kQ queries of one head, rows I0 = I kQ .. I0 + rows - 1: S[ii][j] (row stride Lp) =
// exp(logit - row max) for the keys j in [J0 kQ, min(L, (I + 1) kQ)) (0 where masked: later keys,
// keys at distance >= window, other documents), tot[ii] the row's sum, rows = min(kQ, L - I0). qh:
// the head's queries (L x D); qs: scratch for the chunk's (kQ x D); kt: the head's keys_by_block;
// sb: the row's document ids. Optional distance terms (LaS attention's ELD and ALiBi), each a
// table by distance (distance_table): the logit becomes logit * mul[i - j] - add[i - j] before
// the mask. Returns J0, the first key block the window reaches.
int64_t attention_chunk(const float* qh, float* qs, const float* kt, const int32_t* sb, int64_t L, int64_t D,
                        int64_t Lp, int64_t window, int64_t I, float* S, float* tot, const float* mul = nullptr,
                        const float* add = nullptr) {
  static const float lane_index[kQ] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
  std::fill(qs, qs + kQ * D, 0.0f);
  std::copy(qh + I0 * D, qh + (I0 + rows) * D, qs);
  const int64_t J0 = std::max<int64_t>(0, I0 - window + 1) / kQ;
#ifdef __AVX512F__
  for (int64_t r0 = 0; r0 < kQ; r0 += 8)
    for (int64_t J = J0; J <= I; J += 2) {
      if (J < I)
        product8<2>(qs + r0 * D, 1, D, kt + J * D * kQ, kQ, D * kQ, D, S + r0 * Lp + J * kQ, Lp);
      else
        product8<1>(qs + r0 * D, 1, D, kt + J * D * kQ, kQ, D * kQ, D, S + r0 * Lp + J * kQ, Lp);
    }
#else  // one key block at a time
  for (int64_t J = J0; J <= I; ++J) rows16_product(qs, 1, D, kt + J * D * kQ, kQ, D * kQ, D, S + J * kQ, Lp);
#endif
  if (mul || add)  // x[j] * mul[i - j] - add[i - j], the tables read backwards from L - 1 - i
    for (int64_t ii = 0; ii < rows; ++ii) {
      const int64_t back = L - 1 - (I0 + ii);
      float* x = S + ii * Lp;
      for (int64_t j = J0 * kQ; j < (I + 1) * kQ; j += kW) {
        vw v = load<vw>(x + j);
        if (mul) v = v * load<vw>(mul + back + j);
        if (add) v = v - load<vw>(add + back + j);
        store(x + j, v);
      }
    }
  // One document over the chunk's reach: a block left of the diagonal that every row's window
  // covers needs no mask.
  bool one_doc = true;
  for (int64_t j = J0 * kQ; j < I0 + rows && one_doc; ++j) one_doc = sb[j] == sb[I0];
  // The mask and the maxima in machine vectors (vw): without AVX-512, GCC lowers a v16's
  // comparisons and selects poorly (see vexp).
  const vw wlane = load<vw>(lane_index), wninf = splat<vw>(-__builtin_inff());
  for (int64_t J = J0; J <= I; ++J) {  // the mask
    if (one_doc && J < I && I0 + rows - 1 - J * kQ < window) continue;
    int32_t sj[kQ];
    for (int64_t jj = 0; jj < kQ; ++jj) sj[jj] = J * kQ + jj < L ? sb[J * kQ + jj] : -1;
    for (int64_t h = 0; h < kQ; h += kW) {
      const vw col = splat<vw>(static_cast<float>(J * kQ + h)) + wlane;
      vwi sh;
      std::memcpy(&sh, sj + h, sizeof(sh));
      for (int64_t ii = 0; ii < rows; ++ii) {
        const int64_t i = I0 + ii;
        const vw fi = splat<vw>(static_cast<float>(i));
        const auto vis = (col <= fi) & (fi - col < splat<vw>(static_cast<float>(window))) & (sh == sb[i]);
        float* x = S + ii * Lp + J * kQ + h;
        store(x, vis ? load<vw>(x) : wninf);
      }
    }
  }
  for (int64_t ii = 0; ii < rows; ++ii) {
    float* s = S + ii * Lp;
    vw mx = wninf;
    for (int64_t j = J0 * kQ; j < (I + 1) * kQ; j += kW) {
      const vw x = load<vw>(s + j);
      mx = x > mx ? x : mx;
    }
    float m = mx[0];
    for (int64_t jj = 1; jj < kW; ++jj) m = std::max(m, mx[jj]);  // finite: the diagonal is visible
    // The sums in machine vectors, one per kW lanes of the chunk (a v16 sum stays on the stack
    // in an AVX2 build: Jamba's attention layer on an AMD EPYC 3.8 against 4.1-4.5 ms, fastest of
    // 200 calls); added up lane by lane in the chunk's order.
    constexpr int64_t H = kQ / kW;
    vw sum[H];
#pragma GCC unroll 2
    for (int64_t h = 0; h < H; ++h) sum[h] = splat<vw>(0.0f);
    for (int64_t J = J0; J <= I; ++J)
#pragma GCC unroll 2
      for (int64_t h = 0; h < H; ++h) {
        const vw e = vexp_lanes<vw, vwi>(load<vw>(s + J * kQ + h * kW) - splat<vw>(m));
        store(s + J * kQ + h * kW, e);
        sum[h] += e;
      }
    float t = 0.0f;
    for (int64_t jj = 0; jj < kQ; ++jj) t += sum[jj / kW][jj % kW];
    tot[ii] = t;
  }
  return J0;
}

// Checks shared by the attention kernels: q (B,n,L,d), k (B,KV,L,d), kv head map (n,) in range,
// seg (B,L), window >= 1.
ffi::Error check_attention(const std::string& name, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                           ffi::Span<const int64_t> md, ffi::Span<const int64_t> sd, const int32_t* kv,
                           int64_t window) {
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 1 || sd.size() != 2 || kd[0] != qd[0] ||
      kd[2] != qd[2] || kd[3] != qd[3] || md[0] != qd[1] || sd[0] != qd[0] || sd[1] != qd[2])
    return ffi::Error::InvalidArgument(name + ": expected q (B,n,L,d), k (B,KV,L,d), kv head map (n,), seg (B,L)");
  for (int64_t h = 0; h < qd[1]; ++h)
    if (kv[h] < 0 || kv[h] >= kd[1]) return ffi::Error::InvalidArgument(name + ": key head index out of range");
  if (window < 1) return ffi::Error::InvalidArgument(name + ": window must be >= 1");
  return ffi::Error::Success();
}

ffi::Error AttentionDenseImpl(ffi::ThreadPool xla,
                              ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::S32> kv,
                              ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out, int64_t window,
                              int64_t threads, int64_t huge_pages, int64_t stream) {
  ffi::Error bad = check_attention("attention_dense", q.dimensions(), k.dimensions(), kv.dimensions(),
                                   seg.dimensions(), kv.typed_data(), window);
  if (!bad.success()) return bad;
  auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t B = qd[0], n = qd[1], L = qd[2], D = qd[3], KV = kd[1];
  if (L == 0 || n == 0 || B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(L) * L;
  if (huge_pages) advise_huge(o, LL * B * n * sizeof(float));
  const int64_t nc = (L + kQ - 1) / kQ, Lp = nc * kQ;
  const std::unique_ptr<float[]> kT = keys_by_block(xla, threads, k.typed_data(), B * KV, L, D);
  const int32_t* sg = seg.typed_data();
  const int64_t items = B * n * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> qs(kQ * D), S(kQ * Lp), tot(kQ), buf(stream ? L : 0);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, h = (p / nc) % n, b = p / (nc * n);
      const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
      const float* qh = q.typed_data() + (static_cast<size_t>(b) * n + h) * L * D;
      const float* kt = kT.get() + (static_cast<size_t>(b) * KV + kv.typed_data()[h]) * D * Lp;
      const int64_t J0 = attention_chunk(qh, qs.data(), kt, sg + static_cast<size_t>(b) * L, L, D, Lp, window, I,
                                         S.data(), tot.data());
      for (int64_t ii = 0; ii < rows; ++ii) {
        const int64_t i = I0 + ii;
        const float* s = S.data() + ii * Lp;
        StreamedRow row(o + ((static_cast<size_t>(b) * n + h) * L + i) * L, stream ? buf.data() : nullptr, L);
        float* orow = row.data();
        const int64_t lo = J0 * kQ, width = std::min(L, (I + 1) * kQ);
        std::memset(orow, 0, sizeof(float) * lo);
        const float inv = 1.0f / tot[ii];  // a product per element: a division costs several times more
        int64_t j = lo;
        if (std::isnan(inv)) {  // a NaN logit in the row: NaN on its visible entries, the mask's exact zeros kept
          const int32_t* sb = sg + static_cast<size_t>(b) * L;
          for (; j < width; ++j) orow[j] = j <= i && i - j < window && sb[j] == sb[i] ? s[j] * inv : 0.0f;
        }
        const v16 iv = splat(inv);
        for (; j + kQ <= width; j += kQ) store(orow + j, load(s + j) * iv);
        for (; j < width; ++j) orow[j] = s[j] * inv;
        if (width < L) std::memset(orow + width, 0, sizeof(float) * (L - width));
      }
    }
    if (stream) _mm_sfence();
  });
  return ffi::Error::Success();
}

// A distance term of LaS attention as attention_chunk reads it: t[x] = f(L - 1 - x) for x in
// [0, L - 1 + Lp), f(d) = exp(-rate d) (ELD, mul = true) or rate d (ALiBi), and f = 1 or 0 at the
// negative distances (keys after the query: D_L is 0 above the diagonal), as ops.las_scores forms
// them in float32 (exp of the product -rate * d).
std::vector<float> distance_table(float rate, bool mul, int64_t L, int64_t Lp) {
  std::vector<float> t(static_cast<size_t>(L - 1 + Lp));
  for (int64_t x = 0; x < L - 1 + Lp; ++x) {
    const float d = static_cast<float>(std::max<int64_t>(L - 1 - x, 0));
    t[x] = mul ? std::exp(-rate * d) : rate * d;
  }
  return t;
}

// LaS attention (LaSCore, ops.las_probs): per head the softmax of attention_chunk with the ELD
// factor exp(-alpha (i - j)) and the ALiBi term -slope (i - j), keys in the query's block
// [s_i, i] (s_i = chunk floor(i / chunk); 0 without blocks), then each row averaged over keys
// j + lo .. j + hi (pool P = hi - lo + 1; lo = 0 causal, -(P / 2) centered; zero padding counted,
// summed in the order of ops.pool_rows and divided by P), kept on [s_i, i], exact zeros elsewhere.
// A row with a NaN (or infinite) logit is NaN on [s_i, i], as XLA's softmax gives.
ffi::Error LasDenseImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::S32> heads, ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> slope,
                        ffi::ResultBuffer<ffi::F32> out, int64_t has_alpha, int64_t has_slope, int64_t pool,
                        int64_t lo, int64_t chunk, int64_t threads, int64_t huge_pages, int64_t stream) {
  auto qd = q.dimensions(), kd = k.dimensions(), hd = heads.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || hd.size() != 1 || kd[0] != qd[0] || kd[2] != qd[2] || kd[3] != qd[3] ||
      hd[0] != qd[1] || alpha.dimensions().size() != 1 || alpha.dimensions()[0] != qd[1] ||
      slope.dimensions().size() != 1 || slope.dimensions()[0] != qd[1])
    return ffi::Error::InvalidArgument("las_dense: expected q (B,n,L,d), k (B,H,L,d), heads, alpha, slope (n,)");
  const int64_t B = qd[0], n = qd[1], L = qd[2], D = qd[3], H = kd[1];
  for (int64_t h = 0; h < n; ++h)
    if (heads.typed_data()[h] < 0 || heads.typed_data()[h] >= H)
      return ffi::Error::InvalidArgument("las_dense: head index out of range");
  if (pool < 1 || pool % 2 == 0 || (lo != 0 && lo != -(pool / 2)) || chunk < 0)
    return ffi::Error::InvalidArgument("las_dense: pool must be odd >= 1, lo 0 or -(pool / 2), chunk >= 0");
  if (L == 0 || n == 0 || B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(L) * L;
  if (huge_pages) advise_huge(o, LL * B * n * sizeof(float));
  const int64_t nc = (L + kQ - 1) / kQ, Lp = nc * kQ, hi = lo + pool - 1;
  const std::unique_ptr<float[]> kT = keys_by_block(xla, threads, k.typed_data(), B * H, L, D);
  std::vector<int32_t> block(L);
  for (int64_t j = 0; j < L; ++j) block[j] = chunk ? static_cast<int32_t>(j / chunk) : 0;
  std::vector<std::vector<float>> muls(n), adds(n);
  const int64_t tables = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  run_threads(xla, tables, [&](int64_t t0) {  // a scalar exp per distance and head: in threads too
    for (int64_t h = t0; h < n; h += tables) {
      if (has_alpha) muls[h] = distance_table(alpha.typed_data()[h], true, L, Lp);
      if (has_slope) adds[h] = distance_table(slope.typed_data()[h], false, L, Lp);
    }
  });
  const int64_t items = B * n * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float fp = static_cast<float>(pool);
  run_threads(xla, nt, [&](int64_t t0) {
    // S's rows with a margin of at least pool zeros on both sides, whole vectors (aligned as
    // attention_dense's rows): the windows read past the keys attention_chunk wrote, where the row is 0
    const int64_t margin = pool == 1 ? 0 : (pool + kQ - 1) / kQ * kQ, stride = Lp + 2 * margin;
    std::vector<float> qs(kQ * D), S(kQ * stride, 0.0f), tot(kQ), buf(stream ? L : 0);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, h = (p / nc) % n, b = p / (nc * n);
      const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
      const float* qh = q.typed_data() + (static_cast<size_t>(b) * n + h) * L * D;
      const float* kt = kT.get() + (static_cast<size_t>(b) * H + heads.typed_data()[h]) * D * Lp;
      // a window reaching the chunk's first block start from each of its rows: no key block before it
      const int64_t reach = chunk ? I0 + kQ - (I0 / chunk) * chunk : L;
      const int64_t J0 = attention_chunk(qh, qs.data(), kt, block.data(), L, D, stride, reach, I, S.data() + margin,
                                         tot.data(), has_alpha ? muls[h].data() : nullptr,
                                         has_slope ? adds[h].data() : nullptr);
      for (int64_t ii = 0; ii < rows; ++ii) {
        const int64_t i = I0 + ii, s0 = chunk ? (i / chunk) * chunk : 0;
        float* s = S.data() + margin + ii * stride;
        StreamedRow row(o + ((static_cast<size_t>(b) * n + h) * L + i) * L, stream ? buf.data() : nullptr, L);
        float* orow = row.data();
        std::memset(orow, 0, sizeof(float) * s0);
        if (i + 1 < L) std::memset(orow + i + 1, 0, sizeof(float) * (L - i - 1));
        const float inv = 1.0f / tot[ii];
        if (std::isnan(inv)) {
          std::fill(orow + s0, orow + i + 1, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        const vw iv = splat<vw>(inv), vp = splat<vw>(fp);
        int64_t j = s0;
        if (pool == 1) {
          for (; j + kW <= i + 1; j += kW) store(orow + j, load<vw>(s + j) * iv);
          for (; j <= i; ++j) orow[j] = s[j] * inv;
          continue;
        }
        // The windows of keys s0 .. i read s0 + lo .. i + hi: keys in [J0 kQ, (I + 1) kQ) are 0 where
        // masked (before s0 in another block, after i), the pool entries on either side are zeroed
        // (stale from the last chunk). Summed in ops.pool_rows' order, then divided by P.
        std::fill(s + J0 * kQ - pool, s + J0 * kQ, 0.0f);
        std::fill(s + (I + 1) * kQ, s + (I + 1) * kQ + pool, 0.0f);
        for (; j + kW <= i + 1; j += kW) {
          vw acc = load<vw>(s + j + lo) * iv;
          for (int64_t m = lo + 1; m <= hi; ++m) acc += load<vw>(s + j + m) * iv;
          store(orow + j, acc / vp);
        }
        for (; j <= i; ++j) {
          float acc = s[j + lo] * inv;
          for (int64_t m = lo + 1; m <= hi; ++m) acc += s[j + m] * inv;
          orow[j] = acc / fp;
        }
      }
    }
    if (stream) _mm_sfence();
  });
  return ffi::Error::Success();
}

// Softmax attention applied to the values, out[b, h, i] = sum_j P[i, j] v[b, kv[h], j] with P the
// rows attention_dense writes, without forming them: per chunk of kQ queries the visible keys'
// exp(logit - max) (attention_chunk), times the values (product8, the values padded to whole
// pairs of vectors), over the row sums.
ffi::Error AttentionForwardImpl(ffi::ThreadPool xla,
                                ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                ffi::Buffer<ffi::S32> kv, ffi::Buffer<ffi::S32> seg,
                                ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t threads) {
  ffi::Error bad = check_attention("attention_forward", q.dimensions(), k.dimensions(), kv.dimensions(),
                                   seg.dimensions(), kv.typed_data(), window);
  if (!bad.success()) return bad;
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return ffi::Error::InvalidArgument("attention_forward: expected v (B,KV,L,e)");
  const int64_t B = qd[0], n = qd[1], L = qd[2], D = qd[3], KV = kd[1], E = vd[3];
  if (L == 0 || n == 0 || B == 0 || E == 0) return ffi::Error::Success();
  const int64_t nc = (L + kQ - 1) / kQ, Lp = nc * kQ, Ep = (E + 2 * kQ - 1) / (2 * kQ) * (2 * kQ);
  const std::unique_ptr<float[]> kT = keys_by_block(xla, threads, k.typed_data(), B * KV, L, D);
  std::vector<float> vp;  // values padded to Ep columns (only where E is not a multiple of 2 kQ)
  const float* vs = v.typed_data();
  if (Ep != E) {
    vp.assign(static_cast<size_t>(B) * KV * L * Ep, 0.0f);
    for (int64_t r = 0; r < B * KV * L; ++r) std::copy(vs + r * E, vs + (r + 1) * E, vp.begin() + r * Ep);
    vs = vp.data();
  }
  const int32_t* sg = seg.typed_data();
  float* o = out->typed_data();
  const int64_t items = B * n * nc;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> qs(kQ * D), S(kQ * Lp), tot(kQ), y(kQ * Ep);
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t I = p % nc, h = (p / nc) % n, b = p / (nc * n);
      const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
      const float* qh = q.typed_data() + (static_cast<size_t>(b) * n + h) * L * D;
      const size_t head = static_cast<size_t>(b) * KV + kv.typed_data()[h];
      const int64_t J0 = attention_chunk(qh, qs.data(), kT.get() + head * D * Lp, sg + static_cast<size_t>(b) * L, L,
                                         D, Lp, window, I, S.data(), tot.data());
      const int64_t lo = J0 * kQ, width = std::min(L, (I + 1) * kQ);
      if (rows < kQ)  // rows past L: no NaN from their unset sums reaches a stored row, but keep them finite
        std::fill(S.begin() + rows * Lp, S.end(), 0.0f);
      const float* vh = vs + (head * L + lo) * Ep;
#ifdef __AVX512F__
      for (int64_t r0 = 0; r0 < kQ; r0 += 8)
        for (int64_t e0 = 0; e0 < Ep; e0 += 2 * kQ)
          product8<2>(S.data() + r0 * Lp + lo, 1, Lp, vh + e0, Ep, kQ, width - lo, y.data() + r0 * Ep + e0, Ep);
#else  // one vector of 16 at a time, as above
      for (int64_t e0 = 0; e0 < Ep; e0 += kQ)
        rows16_product(S.data() + lo, 1, Lp, vh + e0, Ep, kQ, width - lo, y.data() + e0, Ep);
#endif
      for (int64_t ii = 0; ii < rows; ++ii) {
        const float inv = 1.0f / tot[ii];
        const float* yr = y.data() + ii * Ep;
        float* orow = o + ((static_cast<size_t>(b) * n + h) * L + I0 + ii) * E;
        for (int64_t e = 0; e < E; ++e) orow[e] = yr[e] * inv;
      }
    }
  });
  return ffi::Error::Success();
}

// Lanes of two vectors picked by constant indices (0..15: a's lanes, 16..31: b's).
template <int... I>
inline v16 select2(v16 a, v16 b) {
#ifdef __clang__
  return __builtin_shufflevector(a, b, I...);
#else
  return __builtin_shuffle(a, b, v16i{I...});
#endif
}

// One stage of a 16 x 16 transpose: rows r and r | B (bit B of r clear) swap bit B of the row
// index with bit B of the lane index. The four stages B = 1, 2, 4, 8 swap every bit.
template <int B, size_t... C>
inline void transpose_stage(v16 (&m)[16], std::index_sequence<C...>) {
  for (int r = 0; r < 16; ++r) {
    if (r & B) continue;
    const v16 a = m[r], b = m[r | B];
    m[r] = select2<static_cast<int>((C & B) ? 16 + (C ^ B) : C)...>(a, b);
    m[r | B] = select2<static_cast<int>((C & B) ? 16 + C : (C | B))...>(a, b);
  }
}

// m[i][j] <- m[j][i].
inline void transpose16(v16 (&m)[16]) {
  transpose_stage<1>(m, std::make_index_sequence<16>{});
  transpose_stage<2>(m, std::make_index_sequence<16>{});
  transpose_stage<4>(m, std::make_index_sequence<16>{});
  transpose_stage<8>(m, std::make_index_sequence<16>{});
}

// Grouped matrix products of the mixture-of-experts layers. The token copies (copy i = t k + j, token
// t's j-th expert) sit in packs of kGroupTile columns, each pack one expert's: col[i] is copy i's
// column (pack col / kGroupTile), owner[p] pack p's expert, -1 for the packs past the copies. W is
// (E, R, K) as the checkpoint stores it. product8 keeps 8 rows x kGroupTile columns of sums in
// registers while an expert's 8 weight rows (8 K floats) stay in L1. Every column is its own
// copy's: a NaN stays in its token's outputs.
constexpr int64_t kGroupTile = 32;

// The grouped products' shared checks: every pack's expert in [-1, E), the n copies' columns
// distinct and inside the P packs. Fills copy: each column's copy, -1 for none.
ffi::Error check_layout(const std::string& name, const int32_t* own, int64_t P, int64_t E, const int32_t* col,
                        int64_t n, std::vector<int32_t>& copy) {
  for (int64_t p = 0; p < P; ++p)
    if (own[p] < -1 || own[p] >= E) return ffi::Error::InvalidArgument(name + ": a pack's expert is outside [-1, E)");
  copy.assign(P * kGroupTile, -1);
  for (int64_t i = 0; i < n; ++i) {
    if (col[i] < 0 || col[i] >= P * kGroupTile || copy[col[i]] >= 0)
      return ffi::Error::InvalidArgument(name + ": a column is outside the packs or taken twice");
    copy[col[i]] = static_cast<int32_t>(i);
  }
  return ffi::Error::Success();
}

// Weight rows per product: with AVX-512's 32 registers 12 rows of 2 vectors of sums (24), with
// AVX2's 16 registers 6 rows of one 16-float vector (12 sums in machine vectors, beside the column
// vectors and a broadcast; 8 rows spilled: from_tokens 4.7 against 3.9 ms in a haswell build).
#ifdef __AVX512F__
constexpr int kPackRows = 12;
constexpr int kTokenRows = 8;  // grouped_matmul_to_tokens' products: 16-row blocks in parts of this many
#else
constexpr int kPackRows = 6;
constexpr int kTokenRows = 6;
#endif

// out (Rb, kGroupTile) = a (Rb rows, row stride K) times one pack's columns xs (K, kGroupTile); only
// the first kQ columns if half (a pack whose copies all sit there: an expert's last pack). Meanwhile
// next_rows rows (of K) at next are prefetched into L2: the weight rows the caller's next pass
// reads. A thread reads an expert's weights from memory once, and the hardware prefetchers follow
// Rb interleaved 2 KB rows poorly: Qwen3-Next's benchmark layer after a 400 MB sweep took 3.2-3.4
// ms (from_tokens) and 2.3-2.4 ms (to_tokens) without, 2.9-3.0 and 2.05-2.1 ms with.
template <int Rb = 8>
inline void pack_product(const float* a, int64_t K, const float* xs, float* out, bool half = false,
                         const float* next = nullptr, int64_t next_rows = 0) {
  static_assert(Rb <= 16, "the prefetches (Rb K / 16 lines) fit the K steps of the product");
  const int64_t lines = next ? (next_rows * K + 15) / 16 : 0;
#ifdef __AVX512F__
  if (half)
    product8<1, false, Rb>(a, 1, K, xs, kGroupTile, kQ, K, out, kGroupTile, nullptr, 0, next, lines);
  else
    product8<2, false, Rb>(a, 1, K, xs, kGroupTile, kQ, K, out, kGroupTile, nullptr, 0, next, lines);
#else  // Rb rows of 2 machine vectors each, one 16-column half at a time
  for (int64_t h = 0; h < (half ? kQ : kGroupTile); h += kQ)
    product8<1, false, Rb>(a, 1, K, xs + h, kGroupTile, kQ, K, out + h, kGroupTile, nullptr, 0,
                           h == 0 ? next : nullptr, h == 0 ? lines : 0);
#endif
}

// For each of the P packs, whether its copies all sit in its first kQ columns (copy: check_layout's):
// then only those columns are gathered and multiplied.
inline std::vector<char> half_packs(const std::vector<int32_t>& copy, int64_t P) {
  std::vector<char> half(P, 1);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t c = kQ; c < kGroupTile; ++c)
      if (copy[p * kGroupTile + c] >= 0) half[p] = 0;
  return half;
}

// Rows r0 .. r0 + rows - 1 of expert e's weights as Rb rows of K: in place, or copied into ab
// with zero rows after them (the last block of a row count not a multiple of Rb).
template <int Rb = 8>
inline const float* weight_rows(const float* ws, int64_t e, int64_t R, int64_t K, int64_t r0, int64_t rows,
                                std::vector<float>& ab) {
  const float* a = ws + (e * R + r0) * K;
  if (rows == Rb) return a;
  std::fill(ab.begin(), ab.begin() + Rb * K, 0.0f);
  std::copy(a, a + rows * K, ab.begin());
  return ab.data();
}

// Bytes of gathered packs an expert's row blocks are multiplied against in one pass (kept in L2).
constexpr int64_t kGatherBytes = 1 << 20;
// Bytes of an expert's weight rows every one of its packs is multiplied by in one pass (kept in L2).
constexpr int64_t kWeightBytes = 1 << 18;

// Pack p's columns gathered as (K, kGroupTile) from the tokens' rows of x (T, K): each column its
// copy's token (zeros where no copy is), the first width columns. 16 x 16 blocks are transposed in
// registers.
inline void gather_pack(const float* xs, int64_t K, int64_t k, const std::vector<int32_t>& copy, int64_t p,
                        int64_t width, const float* zeros, float* pack) {
  const float* src[kGroupTile];
  for (int64_t c = 0; c < width; ++c) {
    const int32_t i = copy[p * kGroupTile + c];
    src[c] = i >= 0 ? xs + i / k * K : zeros;
  }
  int64_t j0 = 0;
  for (; j0 + kQ <= K; j0 += kQ)
    for (int64_t c0 = 0; c0 < width; c0 += kQ) {
      v16 m[16];
      for (int c = 0; c < 16; ++c) m[c] = load(src[c0 + c] + j0);
      transpose16(m);
      for (int j = 0; j < 16; ++j) store(pack + (j0 + j) * kGroupTile + c0, m[j]);
    }
  for (int64_t j = j0; j < K; ++j)
    for (int64_t c = 0; c < width; ++c) pack[j * kGroupTile + c] = src[c][j];
}

// out[p] = W[owner[p]] x_p (P, R, kGroupTile), x_p (K, kGroupTile) the tokens of pack p's copies as
// columns, gathered from x (T, K) (zero columns where no copy is); zeros where owner[p] is -1. Each
// thread takes a run of consecutive packs (equal shares of the columns to multiply) and goes
// through it an expert at a time: up to kGatherBytes of the expert's packs gathered, then each of
// its row blocks times all of them, so a thread reads an expert's weights from memory once, not
// once per pack (a 2048-wide layer of 32 experts, 400 MB of weights: 42 ms when every pack read
// them).
ffi::Error GroupedFromTokensImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> col,
                                 ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::F32> w,
                                 ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  auto xd = x.dimensions(), cd = col.dimensions(), od = owner.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || cd[0] != xd[0] || od.size() != 1 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("grouped_matmul_from_tokens: expected x (T, K), col (T, k), owner (P,), "
                                       "w (E, R, K)");
  const int64_t T = xd[0], K = xd[1], k = cd[1], P = od[0], E = wd[0], R = wd[1];
  const int32_t* own = owner.typed_data();
  std::vector<int32_t> copy;
  ffi::Error bad = check_layout("grouped_matmul_from_tokens", own, P, E, col.typed_data(), T * k, copy);
  if (!bad.success()) return bad;
  if (P == 0 || R == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* o = out->typed_data();
  const std::vector<char> half = half_packs(copy, P);
  std::vector<int64_t> before(P + 1, 0);  // 16-column halves to multiply in the packs before p
  for (int64_t p = 0; p < P; ++p) before[p + 1] = before[p] + (own[p] < 0 ? 0 : half[p] ? 1 : 2);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, P));
  std::vector<int64_t> first(nt + 1, P);  // thread t's packs: first[t] .. first[t + 1] - 1
  for (int64_t t = 0, p = 0; t < nt; ++t) {
    while (p < P && before[p] * nt < t * before[P]) ++p;
    first[t] = p;
  }
  const int64_t G = std::max<int64_t>(1, kGatherBytes / static_cast<int64_t>(sizeof(float) * K * kGroupTile));
  run_threads(xla, nt, [&](int64_t t) {
    std::vector<float> ab(kPackRows * K, 0.0f), tile(kPackRows * kGroupTile), zeros(K, 0.0f);
    std::vector<float> packs(std::min(G, first[t + 1] - first[t]) * K * kGroupTile);
    for (int64_t p = first[t]; p < first[t + 1];) {
      const int64_t e = own[p];
      if (e < 0) {
        std::memset(o + p * R * kGroupTile, 0, sizeof(float) * R * kGroupTile);
        ++p;
        continue;
      }
      int64_t q = p + 1;  // packs p .. q - 1: expert e's, multiplied together
      while (q < first[t + 1] && q - p < G && own[q] == e) ++q;
      for (int64_t i = p; i < q; ++i)
        gather_pack(xs, K, k, copy, i, half[i] ? kQ : kGroupTile, zeros.data(),
                    packs.data() + (i - p) * K * kGroupTile);
      const int64_t next = q < first[t + 1] ? own[q] : -1;  // this thread's next expert
      for (int64_t r0 = 0; r0 < R; r0 += kPackRows) {
        const int64_t rows = std::min<int64_t>(kPackRows, R - r0);
        const float* a = weight_rows<kPackRows>(ws, e, R, K, r0, rows, ab);
        // while the first pack is multiplied, the weight rows after these come into L2: the next
        // block's, or after the last the next expert's first block
        const float* pf = r0 + kPackRows < R ? ws + (e * R + r0 + kPackRows) * K
                          : next >= 0 && next != e ? ws + next * R * K : nullptr;
        const int64_t pf_rows = r0 + kPackRows < R ? std::min<int64_t>(kPackRows, R - r0 - kPackRows)
                                                   : std::min<int64_t>(kPackRows, R);
        for (int64_t i = p; i < q; ++i) {
          float* dst = rows < kPackRows ? tile.data() : o + (i * R + r0) * kGroupTile;
          pack_product<kPackRows>(a, K, packs.data() + (i - p) * K * kGroupTile, dst, half[i],
                                  i == p ? pf : nullptr, pf_rows);
          if (rows < kPackRows)
            std::copy(tile.begin(), tile.begin() + rows * kGroupTile, o + (i * R + r0) * kGroupTile);
        }
      }
      for (int64_t i = p; i < q; ++i)
        if (half[i])  // the empty columns' products are 0
          for (int64_t r = 0; r < R; ++r) std::fill_n(o + (i * R + r) * kGroupTile + kQ, kGroupTile - kQ, 0.0f);
      p = q;
    }
  });
  return ffi::Error::Success();
}

// out[t] = sum_j weights[t, j] (W[owner[p]] h_p)[:, c] over token t's copies, (p, c) copy t k + j's
// column (T, R). One work item per thread: an equal share of the 16-row blocks, every pack for
// each, so each output element is summed by one thread, in pack order (the same bits for any
// thread count). An expert's blocks go in chunks of kWeightBytes of weights, each chunk through
// all the expert's packs, so the weights are read from memory once, and a pack stays in L1 over
// a chunk's blocks (items of 2 blocks re-read every pack from L3 once per item: 2.18 against 2.06
// ms on one thread at Qwen3-Next's benchmark layer; a 2048-wide layer of 32 experts took 21 ms
// where every pack read all the weights, 16-17 ms in chunks). A pack's 16 x 32 products are
// transposed in registers, then added to 32 tokens' rows.
ffi::Error GroupedToTokensImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> col,
                               ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> owner,
                               ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  auto hd = h.dimensions(), cd = col.dimensions(), gd = weights.dimensions(), od = owner.dimensions(),
       wd = w.dimensions(), outd = out->dimensions();
  if (hd.size() != 3 || hd[2] != kGroupTile || cd.size() != 2 || gd.size() != 2 || gd[0] != cd[0] ||
      gd[1] != cd[1] || od.size() != 1 || od[0] != hd[0] || wd.size() != 3 || wd[2] != hd[1] ||
      outd.size() != 2 || outd[0] != cd[0] || outd[1] != wd[1])
    return ffi::Error::InvalidArgument("grouped_matmul_to_tokens: expected h (P, K, 32), col (T, k), weights "
                                       "(T, k), owner (P,), w (E, R, K)");
  const int64_t P = hd[0], K = hd[1], T = cd[0], k = cd[1], E = wd[0], R = wd[1];
  const int32_t* own = owner.typed_data();
  std::vector<int32_t> copy;
  ffi::Error bad = check_layout("grouped_matmul_to_tokens", own, P, E, col.typed_data(), T * k, copy);
  if (!bad.success()) return bad;
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * R);
  if (P == 0 || R == 0 || T == 0) return ffi::Error::Success();
  const float* hs = h.typed_data();
  const float* ws = w.typed_data();
  const float* g = weights.typed_data();
  // Each column's output row and weight, once, not a division by k per column and row block
  // (Qwen3-Next's benchmark layer: 1.23 ms with the divisions, 1.16 ms without).
  std::vector<float*> dst_row(P * kGroupTile, nullptr);
  std::vector<float> col_w(P * kGroupTile, 0.0f);
  for (int64_t c = 0; c < P * kGroupTile; ++c)
    if (copy[c] >= 0) {
      dst_row[c] = o + copy[c] / k * R;
      col_w[c] = g[copy[c]];
    }
  const int64_t blocks = (R + 15) / 16;
  const int64_t per_item = (blocks + std::max<int64_t>(threads, 1) - 1) / std::max<int64_t>(threads, 1);
  const int64_t items = (blocks + per_item - 1) / per_item;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const std::vector<char> half = half_packs(copy, P);
  // Blocks per chunk: a chunk's weight rows stay in L2 while every pack of the expert goes through it.
  const int64_t chunk = std::max<int64_t>(1, kWeightBytes / static_cast<int64_t>(sizeof(float) * 16 * K));
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> a8(kTokenRows * K, 0.0f), tile((16 + kTokenRows - 1) / kTokenRows * kTokenRows * kGroupTile);
    for (int64_t item = t0; item < items; item += nt) {
      const int64_t b0 = item * per_item, b1 = std::min(blocks, (item + 1) * per_item);
      for (int64_t p0 = 0; p0 < P;) {
        const int64_t e = own[p0];
        int64_t p1 = p0 + 1;  // packs p0 .. p1 - 1: expert e's
        while (p1 < P && own[p1] == e) ++p1;
        if (e < 0) {
          p0 = p1;
          continue;
        }
        const int64_t next = p1 < P ? own[p1] : -1;
        for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
          const int64_t c1 = std::min(b1, c0 + chunk);
          for (int64_t p = p0; p < p1; ++p) {
            // with the expert's last pack, the rows the next chunk reads come into L2: the same rows
            // of the expert's next chunk, or of the next expert's first
            const float* pf = nullptr;
            int64_t shift = 0;
            if (p + 1 == p1 && c1 < b1) {
              pf = ws + e * R * K;
              shift = chunk;
            } else if (p + 1 == p1 && next >= 0) {
              pf = ws + next * R * K;
              shift = b0 - c0;
            }
            for (int64_t b = c0; b < c1; ++b) {
              const int64_t r0 = b * 16, rows = std::min<int64_t>(16, R - r0);
              for (int64_t part = 0; part * kTokenRows < 16; ++part) {
                const int64_t rh = std::min<int64_t>(kTokenRows, rows - kTokenRows * part);
                float* dst = tile.data() + part * kTokenRows * kGroupTile;
                const int64_t rn = r0 + 16 * shift + kTokenRows * part;  // the prefetched rows' first
                const int64_t pf_rows = pf && rn < R ? std::min<int64_t>(kTokenRows, R - rn) : 0;
                if (rh <= 0)
                  std::fill(dst, dst + kTokenRows * kGroupTile, 0.0f);
                else
                  pack_product<kTokenRows>(weight_rows<kTokenRows>(ws, e, R, K, r0 + kTokenRows * part, rh, a8), K,
                                           hs + p * K * kGroupTile, dst, half[p], pf_rows > 0 ? pf + rn * K : nullptr,
                                           pf_rows);
              }
              for (int64_t h0 = 0; h0 < (half[p] ? kQ : kGroupTile); h0 += kQ) {
                v16 m[16];
                for (int r = 0; r < 16; ++r) m[r] = load(tile.data() + r * kGroupTile + h0);
                transpose16(m);  // m[c]: column h0 + c's 16 rows
                for (int c = 0; c < 16; ++c) {
                  float* row = dst_row[p * kGroupTile + h0 + c];
                  if (!row) continue;
                  row += r0;
                  const float gi = col_w[p * kGroupTile + h0 + c];
                  if (rows == 16) {
                    store(row, load(row) + splat(gi) * m[c]);
                  } else {
                    for (int64_t r = 0; r < rows; ++r) row[r] += gi * m[c][r];
                  }
                }
              }
            }
          }
        }
        p0 = p1;
      }
    }
  });
  return ffi::Error::Success();
}

// out = x, a copy: a point XLA:CPU cannot fuse across (it drops optimization barriers before it
// fuses), so a small table is computed once, not inside every consumer (the rotary embeddings'
// cosines and sines, which XLA evaluated per head in each of three consumers).
ffi::Error CopyImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  if (x.element_count() != out->element_count()) return ffi::Error::InvalidArgument("copy: sizes differ");
  std::memcpy(out->typed_data(), x.typed_data(), sizeof(float) * x.element_count());
  return ffi::Error::Success();
}

// Copies channels into a larger output in place (a ParallelCore's other parts, a channel
// repeated for each of its slots): out[b, offset + t] = src[b, map[t]].
ffi::Error PlaceChannelsImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> src, ffi::Buffer<ffi::S32> map,
                             ffi::Buffer<ffi::F32> into, ffi::ResultBuffer<ffi::F32> out,
                             int64_t offset, int64_t threads) {
  auto sd = src.dimensions(), md = map.dimensions(), od = out->dimensions();
  if (sd.size() != 4 || md.size() != 1 || od.size() != 4 || sd[0] != od[0] || sd[2] != od[2] ||
      sd[3] != od[3] || offset < 0 || offset + md[0] > od[1])
    return ffi::Error::InvalidArgument("place_channels: inconsistent shapes");
  const int64_t B = od[0], total = od[1], m = sd[1], k = md[0];
  const size_t LL = static_cast<size_t>(od[2]) * od[3];
  for (int64_t t = 0; t < k; ++t)
    if (map.typed_data()[t] < 0 || map.typed_data()[t] >= m)
      return ffi::Error::InvalidArgument("place_channels: source channel out of range");
  float* o = out->typed_data();
  if (o != into.typed_data())  // not aliased after all: start from the input
    std::memcpy(o, into.typed_data(), sizeof(float) * LL * B * total);
  const int64_t items = B * k;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  run_threads(xla, nt, [&](int64_t t0) {
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t b = p / k, t = p % k;
      std::memcpy(o + (static_cast<size_t>(b) * total + offset + t) * LL,
                  src.typed_data() + (static_cast<size_t>(b) * m + map.typed_data()[t]) * LL,
                  sizeof(float) * LL);
    }
  });
  return ffi::Error::Success();
}

// A fresh output of one value, written as the dense kernels write theirs (huge pages where Linux
// gives them, parts of 64 Ki floats dealt to the threads in turn): the benchmarks' bound on writing
// an output (XLA's own fill does not ask for huge pages).
constexpr int64_t kFillPart = int64_t{1} << 16;

ffi::Error FillImpl(ffi::ThreadPool xla, ffi::ResultBuffer<ffi::F32> out, float value, int64_t threads,
                    int64_t huge_pages) {
  const int64_t n = static_cast<int64_t>(out->element_count());
  if (n == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  if (huge_pages) advise_huge(o, static_cast<size_t>(n) * sizeof(float));
  const int64_t items = (n + kFillPart - 1) / kFillPart;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  run_threads(xla, nt, [&](int64_t t0) {
    for (int64_t p = t0; p < items; p += nt) std::fill(o + p * kFillPart, o + std::min(n, (p + 1) * kFillPart), value);
  });
  return ffi::Error::Success();
}

// Whether the selective scan's operands fit together: u, dt (B, L, C); A^T (B, N, C); Bm, Cm (B, L, N);
// N <= kMaxState.
bool scan_operands(ffi::Buffer<ffi::F32>& u, ffi::Buffer<ffi::F32>& dt, ffi::Buffer<ffi::F32>& At,
                   ffi::Buffer<ffi::F32>& Bm, ffi::Buffer<ffi::F32>& Cm) {
  auto ud = u.dimensions(), dd = dt.dimensions(), ad = At.dimensions(), bd = Bm.dimensions(), cd = Cm.dimensions();
  return ud.size() == 3 && dd.size() == 3 && ad.size() == 3 && bd.size() == 3 && cd.size() == 3 &&
         std::equal(ud.begin(), ud.end(), dd.begin()) && std::equal(bd.begin(), bd.end(), cd.begin()) &&
         bd[0] == ud[0] && bd[1] == ud[1] && ad[0] == ud[0] && ad[2] == ud[2] && bd[2] == ad[1] &&
         ad[1] <= kMaxState;
}

// Mamba-1's selective scan (the block's forward, not its operator): per channel c and state n,
//   h[n] = exp(dt[t,c] A[c,n]) h[n] + dt[t,c] u[t,c] Bm[t,n],   y[t,c] = sum_n h[n] Cm[t,n],
// the arithmetic of the XLA sequential scan in the same order. A machine vector's channels
// share it (the state of each n is one vw), so no lane sums are needed; a last block of fewer
// channels runs on zero lanes that are not written back. A comes per batch row (the reverse-mode
// primitive batches by folding a mapped axis into the leading one).
ffi::Error SelectiveScanImpl(ffi::ThreadPool xla,
                             ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> dt, ffi::Buffer<ffi::F32> At,
                             ffi::Buffer<ffi::F32> Bm, ffi::Buffer<ffi::F32> Cm,
                             ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  if (!scan_operands(u, dt, At, Bm, Cm))
    return ffi::Error::InvalidArgument("selective_scan: inconsistent shapes (u, dt (B, L, C); A^T (B, N, C); "
                                       "Bm, Cm (B, L, N); N <= 64)");
  auto ud = u.dimensions();
  const int64_t B = ud[0], L = ud[1], C = ud[2], N = At.dimensions()[1];
  // kW channels per work item, every value a machine vector: with v16s an AVX2 build kept the
  // output sum on the stack (AMD EPYC, Jamba's layer of 1536 channels, 16 states, L = 512: 4.5-5.1
  // against 8.0-8.3 ms, fastest of 100 calls).
  const int64_t blocks = (C + kW - 1) / kW, items = B * blocks;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *pu = u.typed_data(), *pd = dt.typed_data(), *pa = At.typed_data();
  const float *pb = Bm.typed_data(), *pc = Cm.typed_data();
  float* py = y->typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    vw h[kMaxState], a[kMaxState];
    float lane[kW];
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t b = p / blocks, c0 = (p % blocks) * kW, w = std::min<int64_t>(kW, C - c0);
      const auto part = [&](const float* src) {  // kW channels from c0, zeros past C
        if (w == kW) return load<vw>(src);
        std::fill(lane, lane + kW, 0.0f);
        std::memcpy(lane, src, sizeof(float) * w);
        return load<vw>(lane);
      };
      for (int64_t n = 0; n < N; ++n) {
        h[n] = splat<vw>(0.0f);
        a[n] = part(pa + (b * N + n) * C + c0);
      }
      for (int64_t t = 0; t < L; ++t) {
        const size_t row = (static_cast<size_t>(b) * L + t) * C + c0;
        const float* bt = pb + (static_cast<size_t>(b) * L + t) * N;
        const float* ct = pc + (static_cast<size_t>(b) * L + t) * N;
        const vw d = part(pd + row), du = d * part(pu + row);
        vw out = splat<vw>(0.0f);
        for (int64_t n = 0; n < N; ++n) {
          h[n] = vexp_lanes<vw, vwi>(d * a[n]) * h[n] + du * splat<vw>(bt[n]);
          out += h[n] * splat<vw>(ct[n]);
        }
        if (w == kW) {
          store(py + row, out);
        } else {
          store(lane, out);
          std::memcpy(py + row, lane, sizeof(float) * w);
        }
      }
    }
  });
  return ffi::Error::Success();
}

// The sum of a vw's lanes, halving the vector (lane j + lane j + kW/2, and so on down to one).
inline float lane_total(vw v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 h;
  if constexpr (kW == 16) {
    h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  } else {
    std::memcpy(&h, &v, sizeof(h));  // vw is v8 here (the branch above is compiled for both)
  }
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Reverse mode of selective_scan (its operands and the outputs' cotangent dy): the cotangents of u,
// dt, A^T, Bm and Cm. Per work item (a batch row, a vector of channels) a forward pass keeps the
// state at every kScanVjpChunk-th position; then, from the last chunk back, a chunk's decays and
// states are formed again and the state's cotangent g runs backwards:
//   g_t = a_{t+1} g_{t+1} + Cm_t dy_t,   dCm_t += dy_t h_t,   dBm_t += dt_t u_t g_t,
//   x_t = sum_n Bm_t g_t:  du_t = dt_t x_t,  ddt_t = u_t x_t + sum_n A a_t g_t h_{t-1},
//   dA += dt_t a_t g_t h_{t-1}   (a_t = exp(dt_t A), h_{-1} = 0).
// dBm and dCm sum over the channels: a thread adds its items' vectors lane by lane while they are of
// one batch row, sums the lanes when the row changes, and the threads' sums are added at the end.
constexpr int64_t kScanVjpChunk = 32;

ffi::Error SelectiveScanVjpImpl(ffi::ThreadPool xla,
                                ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> dt, ffi::Buffer<ffi::F32> At,
                                ffi::Buffer<ffi::F32> Bm, ffi::Buffer<ffi::F32> Cm, ffi::Buffer<ffi::F32> dy,
                                ffi::ResultBuffer<ffi::F32> du_, ffi::ResultBuffer<ffi::F32> ddt_,
                                ffi::ResultBuffer<ffi::F32> dAt_, ffi::ResultBuffer<ffi::F32> dBm_,
                                ffi::ResultBuffer<ffi::F32> dCm_, int64_t threads) {
  auto ud = u.dimensions(), yd = dy.dimensions();
  if (!scan_operands(u, dt, At, Bm, Cm) || !std::equal(ud.begin(), ud.end(), yd.begin(), yd.end()))
    return ffi::Error::InvalidArgument("selective_scan_vjp: inconsistent shapes (u, dt and the cotangent "
                                       "(B, L, C); A^T (B, N, C); Bm, Cm (B, L, N); N <= 64)");
  const int64_t B = ud[0], L = ud[1], C = ud[2], N = At.dimensions()[1];
  const float *pu = u.typed_data(), *pd = dt.typed_data(), *pa = At.typed_data();
  const float *pb = Bm.typed_data(), *pc = Cm.typed_data(), *py = dy.typed_data();
  float *gu = du_->typed_data(), *gd = ddt_->typed_data(), *ga = dAt_->typed_data();
  float *gb = dBm_->typed_data(), *gc = dCm_->typed_data();
  const size_t row_states = static_cast<size_t>(L) * N;
  std::fill(gb, gb + B * row_states, 0.0f);
  std::fill(gc, gc + B * row_states, 0.0f);
  const int64_t blocks = (C + kW - 1) / kW, items = B * blocks;
  if (items == 0 || L == 0) {
    std::fill(ga, ga + B * N * C, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const int64_t chunks = (L + kScanVjpChunk - 1) / kScanVjpChunk;
  std::vector<float> sums(static_cast<size_t>(nt) * B * row_states * 2, 0.0f);  // per thread: dBm, dCm
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<vw> saved(chunks * N), hs((kScanVjpChunk + 1) * N), as(kScanVjpChunk * N);
    std::vector<vw> laneB(row_states, splat<vw>(0.0f)), laneC(row_states, splat<vw>(0.0f));
    vw a[kMaxState], g[kMaxState], dA[kMaxState];
    float lane[kW];
    int64_t row = -1;
    const auto flush = [&] {  // this thread's lane sums of batch row `row`
      if (row < 0) return;
      float* sb = sums.data() + (static_cast<size_t>(t0) * B + row) * row_states * 2;
      for (size_t i = 0; i < row_states; ++i) {
        sb[i] += lane_total(laneB[i]);
        sb[row_states + i] += lane_total(laneC[i]);
        laneB[i] = laneC[i] = splat<vw>(0.0f);
      }
    };
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t b = p / blocks, c0 = (p % blocks) * kW, w = std::min<int64_t>(kW, C - c0);
      if (b != row) {
        flush();
        row = b;
      }
      const auto part = [&](const float* src) {  // kW channels from c0, zeros past C
        if (w == kW) return load<vw>(src);
        std::fill(lane, lane + kW, 0.0f);
        std::memcpy(lane, src, sizeof(float) * w);
        return load<vw>(lane);
      };
      const auto put = [&](float* dst, vw v) {
        if (w == kW) return store(dst, v);
        store(lane, v);
        std::memcpy(dst, lane, sizeof(float) * w);
      };
      const auto at = [&](int64_t t) { return (static_cast<size_t>(b) * L + t) * C + c0; };
      const float* bb = pb + static_cast<size_t>(b) * row_states;
      const float* cb = pc + static_cast<size_t>(b) * row_states;
      for (int64_t n = 0; n < N; ++n) {
        a[n] = part(pa + (b * N + n) * C + c0);
        hs[n] = g[n] = dA[n] = splat<vw>(0.0f);
      }
      for (int64_t t = 0; t < L; ++t) {  // hs[0..N): the running state
        if (t % kScanVjpChunk == 0) std::copy(hs.begin(), hs.begin() + N, saved.begin() + (t / kScanVjpChunk) * N);
        const vw d = part(pd + at(t)), x = d * part(pu + at(t));
        for (int64_t n = 0; n < N; ++n) hs[n] = vexp_lanes<vw, vwi>(d * a[n]) * hs[n] + x * splat<vw>(bb[t * N + n]);
      }
      for (int64_t k = chunks - 1; k >= 0; --k) {
        const int64_t s = k * kScanVjpChunk, e = std::min(L, s + kScanVjpChunk);
        std::copy(saved.begin() + k * N, saved.begin() + (k + 1) * N, hs.begin());
        for (int64_t t = s; t < e; ++t) {  // hs[(t - s + 1) N + n]: h_t; as[(t - s) N + n]: a_t
          const int64_t j = t - s;
          const vw d = part(pd + at(t)), x = d * part(pu + at(t)), yt = part(py + at(t));
          for (int64_t n = 0; n < N; ++n) {
            const vw decay = vexp_lanes<vw, vwi>(d * a[n]);
            const vw h = decay * hs[j * N + n] + x * splat<vw>(bb[t * N + n]);
            as[j * N + n] = decay;
            hs[(j + 1) * N + n] = h;
            laneC[t * N + n] += yt * h;
          }
        }
        for (int64_t t = e - 1; t >= s; --t) {
          const int64_t j = t - s;
          const vw d = part(pd + at(t)), uu = part(pu + at(t)), yt = part(py + at(t)), x = d * uu;
          vw dx = splat<vw>(0.0f), dd = splat<vw>(0.0f);
          for (int64_t n = 0; n < N; ++n) {
            const vw gn = g[n] + splat<vw>(cb[t * N + n]) * yt;
            laneB[t * N + n] += x * gn;
            dx += splat<vw>(bb[t * N + n]) * gn;
            const vw q = gn * hs[j * N + n] * as[j * N + n];
            dd += a[n] * q;
            dA[n] += d * q;
            g[n] = as[j * N + n] * gn;
          }
          put(gu + at(t), d * dx);
          put(gd + at(t), uu * dx + dd);
        }
      }
      for (int64_t n = 0; n < N; ++n) put(ga + (b * N + n) * C + c0, dA[n]);
    }
    flush();
  });
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t b = 0; b < B; ++b) {
      const float* sb = sums.data() + (static_cast<size_t>(t) * B + b) * row_states * 2;
      float *ob = gb + b * row_states, *oc = gc + b * row_states;
      for (size_t i = 0; i < row_states; ++i) {
        ob[i] += sb[i];
        oc[i] += sb[row_states + i];
      }
    }
  return ffi::Error::Success();
}

// Mamba-2's SSD recurrence, K positions per pass over the state (K <= kSsdSteps): with the state
// S entering the block, A_m = a_0 ... a_m and D_j = a_{j+1} ... a_{K-1},
//   S' = A_{K-1} S + sum_j D_j B_j^T dx_j,   y_m = A_m C_m S + sum_{j <= m} (a_{j+1} ... a_m) (C_m . B_j) dx_j,
// so each row S[n, :] is read and written once per K positions and costs 2K + 1 products instead
// of 3K. This pass does the part that reads the state: the rows' update and C_m S for NV vectors
// of channels (compile-time counts, so everything stays in registers).
#ifdef __AVX512F__
constexpr int kSsdSteps = 4;
#else
constexpr int kSsdSteps = 2;  // 16 registers: K outputs and K inputs per vector, two vectors
#endif
constexpr int kSsdVectors = 2;

// sum_n a[n] b[n], in vectors (a scalar loop would wait on each add).
inline float dot(const float* a, const float* b, int64_t n) {
  vw acc = splat<vw>(0.0f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc += load<vw>(a + i) * load<vw>(b + i);
  float lanes[kW], sum = 0.0f;
  store(lanes, acc);
  for (int l = 0; l < kW; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <int K, int NV>
void ssd_pass(float* state, int64_t stride, int64_t N, float decay, const float* wb, const float* const* c,
              const float* dx, int64_t dx_stride, float* out, int64_t out_stride) {
  vw acc[K][NV], u[K][NV];
  for (int j = 0; j < K; ++j)
    for (int v = 0; v < NV; ++v) {
      acc[j][v] = splat<vw>(0.0f);
      u[j][v] = load<vw>(dx + j * dx_stride + v * kW);
    }
  const vw dk = splat<vw>(decay);
  for (int64_t n = 0; n < N; ++n) {
    float* row = state + n * stride;
    vw bw[K], cw[K];
    for (int j = 0; j < K; ++j) {
      bw[j] = splat<vw>(wb[j * N + n]);
      cw[j] = splat<vw>(c[j][n]);
    }
    for (int v = 0; v < NV; ++v) {
      const vw s = load<vw>(row + v * kW);
      vw e = bw[0] * u[0][v];
      for (int j = 1; j < K; ++j) e += bw[j] * u[j][v];
      for (int m = 0; m < K; ++m) acc[m][v] += cw[m] * s;
      store(row + v * kW, dk * s + e);
    }
  }
  for (int m = 0; m < K; ++m)
    for (int v = 0; v < NV; ++v) store(out + m * out_stride + v * kW, acc[m][v]);
}

template <int K>
void ssd_pass_vectors(int nv, float* state, int64_t stride, int64_t N, float decay, const float* wb,
                      const float* const* c, const float* dx, int64_t dx_stride, float* out, int64_t out_stride) {
  if (nv == 2) ssd_pass<K, 2>(state, stride, N, decay, wb, c, dx, dx_stride, out, out_stride);
  else ssd_pass<K, 1>(state, stride, N, decay, wb, c, dx, dx_stride, out, out_stride);
}

// Mamba-2's SSD (the block's forward): per batch b and head h, the (N, P) state
//   S = exp(dt[t,h] A[h]) S + B[t,g]^T (dt[t,h] x[t,h,:]),   y[t,h,:] = C[t,g] S,
// with g = h / (H / G), in blocks of kSsdSteps positions (ssd_pass). A head's P channels share
// vectors (a row S[n, :] is P floats), so y accumulates in registers with no lane sums; heads
// are spread over the threads. P is padded to whole vectors in scratch; padded lanes are never
// written out.
// Whether the SSD's operands fit together: x (B, L, H, P); dt (B, L, H); A per batch row (B, 1, H);
// Bm, Cm (B, L, G, N) with H a multiple of G.
bool ssd_operands(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& dt, ffi::Buffer<ffi::F32>& A,
                  ffi::Buffer<ffi::F32>& Bm, ffi::Buffer<ffi::F32>& Cm) {
  auto xd = x.dimensions(), dd = dt.dimensions(), ad = A.dimensions(), bd = Bm.dimensions(), cd = Cm.dimensions();
  return xd.size() == 4 && dd.size() == 3 && ad.size() == 3 && bd.size() == 4 && cd.size() == 4 &&
         std::equal(bd.begin(), bd.end(), cd.begin()) && dd[0] == xd[0] && dd[1] == xd[1] && dd[2] == xd[2] &&
         ad[0] == xd[0] && ad[1] == 1 && ad[2] == xd[2] && bd[0] == xd[0] && bd[1] == xd[1] && bd[2] >= 1 &&
         xd[2] % bd[2] == 0;
}

ffi::Error SsdScanImpl(ffi::ThreadPool xla,
                       ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dt, ffi::Buffer<ffi::F32> A,
                       ffi::Buffer<ffi::F32> Bm, ffi::Buffer<ffi::F32> Cm,
                       ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  if (!ssd_operands(x, dt, A, Bm, Cm))
    return ffi::Error::InvalidArgument("ssd_scan: inconsistent shapes (x (B, L, H, P); dt (B, L, H); A (B, 1, H); "
                                       "Bm, Cm (B, L, G, N) with H a multiple of G)");
  auto xd = x.dimensions();
  const int64_t B = xd[0], L = xd[1], H = xd[2], P = xd[3], G = Bm.dimensions()[2], N = Bm.dimensions()[3];
  if (B == 0 || L == 0 || H == 0 || P == 0) return ffi::Error::Success();
  constexpr int K = kSsdSteps;
  const int64_t pv = (P + kW - 1) / kW, Pp = pv * kW, items = B * H;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *px = x.typed_data(), *pd = dt.typed_data(), *pa = A.typed_data();
  const float *pb = Bm.typed_data(), *pc = Cm.typed_data();
  float* py = y->typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> state(static_cast<size_t>(N) * Pp), dx(K * Pp, 0.0f), out(K * Pp), wb(K * N);
    for (int64_t item = t0; item < items; item += nt) {
      const int64_t b = item / H, h = item % H, g = h / (H / G);
      std::fill(state.begin(), state.end(), 0.0f);
      for (int64_t t = 0; t < L; t += K) {
        const int k = static_cast<int>(std::min<int64_t>(K, L - t));
        float a[K], run[K + 1];
        const float* c[K];
        const float* bs[K];
        for (int j = 0; j < k; ++j) {
          const size_t bt = static_cast<size_t>(b) * L + t + j;
          const float d = pd[bt * H + h];
          a[j] = std::exp(d * pa[b * H + h]);
          const float* xt = px + (bt * H + h) * P;
          for (int64_t p = 0; p < P; ++p) dx[j * Pp + p] = d * xt[p];
          bs[j] = pb + (bt * G + g) * N;
          c[j] = pc + (bt * G + g) * N;
        }
        run[k] = 1.0f;  // run[j] = a_j ... a_{k-1}
        for (int j = k - 1; j >= 0; --j) run[j] = run[j + 1] * a[j];
        for (int j = 0; j < k; ++j) {  // D_j B_j
          const float w = run[j + 1];
          for (int64_t n = 0; n < N; ++n) wb[j * N + n] = w * bs[j][n];
        }
        for (int64_t v0 = 0; v0 < pv; v0 += kSsdVectors) {
          const int nv = static_cast<int>(std::min<int64_t>(kSsdVectors, pv - v0));
          float *s = state.data() + v0 * kW, *u = dx.data() + v0 * kW, *o = out.data() + v0 * kW;
          switch (k) {  // k <= K: the last block may be shorter
            case 1: ssd_pass_vectors<1>(nv, s, Pp, N, run[0], wb.data(), c, u, Pp, o, Pp); break;
            case 2: ssd_pass_vectors<2>(nv, s, Pp, N, run[0], wb.data(), c, u, Pp, o, Pp); break;
            case 3: ssd_pass_vectors<3>(nv, s, Pp, N, run[0], wb.data(), c, u, Pp, o, Pp); break;
            default: ssd_pass_vectors<4>(nv, s, Pp, N, run[0], wb.data(), c, u, Pp, o, Pp); break;
          }
        }
        // y_m = A_m (C_m S) + sum_{j <= m} (a_{j+1} ... a_m) (C_m . B_j) dx_j
        float am = 1.0f;  // A_m = a_0 ... a_m
        for (int m = 0; m < k; ++m) {
          float* o = out.data() + m * Pp;
          am *= a[m];
          float decay = 1.0f;
          for (int j = m; j >= 0; --j) {  // decay = a_{j+1} ... a_m
            const float w = decay * dot(c[m], bs[j], N);
            const float* u = dx.data() + j * Pp;
            if (j == m) {
              for (int64_t p = 0; p < P; ++p) o[p] = am * o[p] + w * u[p];
            } else {
              for (int64_t p = 0; p < P; ++p) o[p] += w * u[p];
            }
            decay *= a[j];
          }
          std::memcpy(py + ((static_cast<size_t>(b) * L + t + m) * H + h) * P, o, sizeof(float) * P);
        }
      }
    }
  });
  return ffi::Error::Success();
}

// Reverse mode of ssd_scan (its operands and the outputs' cotangent dy): the cotangents of x, dt, A,
// Bm and Cm. A work item is a batch row, a head and kSsdVjpRows of its channels p (the rows S[p, :]
// of the state evolve independently given a_t, B_t), with vectors along the states n. A forward
// sweep stores the rows every kSsdVjpChunk positions; then, from the last chunk back, a chunk's
// states are formed again and the rows' cotangent G runs backwards:
//   G_t = a_{t+1} G_{t+1} + dy_t C_t^T,   dC_t += sum_p dy_t[p] S_t[p, :],   dB_t += sum_p dt_t x_t[p] G_t[p, :],
//   e_t[p] = G_t[p, :] . B_t:  dx_t[p] = dt_t e_t[p],  ddt_t += sum_p x_t[p] e_t[p] + A a_t (G_t . S_{t-1}),
//   dA += dt_t a_t (G_t . S_{t-1})   (a_t = exp(dt_t A), S_{-1} = 0).
// The sums over channels, heads of a group and row blocks go to per-thread arrays, added at the end.
constexpr int64_t kSsdVjpChunk = 16;
constexpr int64_t kSsdVjpRows = 16;

ffi::Error SsdScanVjpImpl(ffi::ThreadPool xla,
                          ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dt, ffi::Buffer<ffi::F32> A,
                          ffi::Buffer<ffi::F32> Bm, ffi::Buffer<ffi::F32> Cm, ffi::Buffer<ffi::F32> dy,
                          ffi::ResultBuffer<ffi::F32> dx_, ffi::ResultBuffer<ffi::F32> ddt_,
                          ffi::ResultBuffer<ffi::F32> dA_, ffi::ResultBuffer<ffi::F32> dB_,
                          ffi::ResultBuffer<ffi::F32> dC_, int64_t threads) {
  auto xd = x.dimensions(), yd = dy.dimensions();
  if (!ssd_operands(x, dt, A, Bm, Cm) || !std::equal(xd.begin(), xd.end(), yd.begin(), yd.end()))
    return ffi::Error::InvalidArgument("ssd_scan_vjp: inconsistent shapes (x and the cotangent (B, L, H, P); "
                                       "dt (B, L, H); A (B, 1, H); Bm, Cm (B, L, G, N) with H a multiple of G)");
  const int64_t B = xd[0], L = xd[1], H = xd[2], P = xd[3], G = Bm.dimensions()[2], N = Bm.dimensions()[3];
  const float *px = x.typed_data(), *pd = dt.typed_data(), *pa = A.typed_data();
  const float *pb = Bm.typed_data(), *pc = Cm.typed_data(), *py = dy.typed_data();
  float *gx = dx_->typed_data(), *gd = ddt_->typed_data(), *ga = dA_->typed_data();
  float *gb = dB_->typed_data(), *gc = dC_->typed_data();
  const size_t groups = static_cast<size_t>(B) * L * G * N, steps = static_cast<size_t>(B) * L * H;
  std::fill(gx, gx + steps * P, 0.0f);
  std::fill(gd, gd + steps, 0.0f);
  std::fill(ga, ga + B * H, 0.0f);
  std::fill(gb, gb + groups, 0.0f);
  std::fill(gc, gc + groups, 0.0f);
  const int64_t R = kSsdVjpRows, blocks = (P + R - 1) / R, items = B * H * blocks;
  if (items == 0 || L == 0 || N == 0) return ffi::Error::Success();
  const int64_t nvec = (N + kW - 1) / kW, Npad = nvec * kW, hg = H / G;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const int64_t chunks = (L + kSsdVjpChunk - 1) / kSsdVjpChunk;
  const size_t padded = static_cast<size_t>(B) * L * G * Npad;
  // per thread: dB, dC (B, L, G, Np), ddt (B, L, H), dA (B, H)
  const size_t per_thread = 2 * padded + steps + B * H;
  std::vector<float> sums(static_cast<size_t>(nt) * per_thread, 0.0f);
  run_threads(xla, nt, [&](int64_t t0) {
    float* sb = sums.data() + static_cast<size_t>(t0) * per_thread;
    float *sc = sb + padded, *sd = sc + padded, *sa = sd + steps;
    const int64_t Np = Npad, nv = nvec;  // locals: the compiler keeps them in registers past the stores
    const size_t rows = static_cast<size_t>(R) * Np;
    std::vector<float> bpad(static_cast<size_t>(L) * Np, 0.0f), cpad(static_cast<size_t>(L) * Np, 0.0f);
    std::vector<float> saved(chunks * rows), hs((kSsdVjpChunk + 1) * rows), adj(rows), decay(L);
    vw ev[kSsdVjpRows], gsv[kSsdVjpRows];
    int64_t cached = -1;  // the (b, g) whose Bm, Cm rows bpad, cpad hold
    for (int64_t item = t0; item < items; item += nt) {
      const int64_t b = item / (H * blocks), h = (item / blocks) % H, r0 = (item % blocks) * R;
      const int64_t w = std::min<int64_t>(R, P - r0), g = h / hg;
      if (b * G + g != cached) {
        cached = b * G + g;
        for (int64_t t = 0; t < L; ++t) {
          const size_t src = ((static_cast<size_t>(b) * L + t) * G + g) * N;
          std::copy(pb + src, pb + src + N, bpad.begin() + t * Np);
          std::copy(pc + src, pc + src + N, cpad.begin() + t * Np);
        }
      }
      const float Ah = pa[b * H + h];
      const size_t base = static_cast<size_t>(b) * L * H + h;  // step t of this head: base + t H
      const size_t gbase = (static_cast<size_t>(b) * L * G + g) * Np;  // (b, t, g) of dB, dC: gbase + t G Np
      for (int64_t t = 0; t < L; ++t) decay[t] = std::exp(pd[base + t * H] * Ah);
      // this step's x, dt x and dy over the block's rows, zeros past w (those rows stay 0 throughout)
      float xr[R], xv[R], yr[R];
      const auto rows_at = [&](int64_t t) {
        const float d = pd[base + t * H];
        const float *xt = px + (base + t * H) * P + r0, *yt = py + (base + t * H) * P + r0;
        for (int64_t p = 0; p < R; ++p) {
          xv[p] = p < w ? xt[p] : 0.0f;
          xr[p] = d * xv[p];
          yr[p] = p < w ? yt[p] : 0.0f;
        }
      };
      std::fill(hs.begin(), hs.begin() + rows, 0.0f);
      for (int64_t t = 0; t < L; ++t) {  // hs[0, rows): the running rows
        if (t % kSsdVjpChunk == 0) std::copy(hs.begin(), hs.begin() + rows, saved.begin() + (t / kSsdVjpChunk) * rows);
        rows_at(t);
        const vw av = splat<vw>(decay[t]);
        const float* bt = bpad.data() + t * Np;
        for (int64_t p = 0; p < R; ++p) {
          float* row = hs.data() + p * Np;
          const vw dx = splat<vw>(xr[p]);
          for (int64_t v = 0; v < nv; ++v)
            store(row + v * kW, av * load<vw>(row + v * kW) + dx * load<vw>(bt + v * kW));
        }
      }
      std::fill(adj.begin(), adj.end(), 0.0f);
      float dA = 0.0f;
      for (int64_t k = chunks - 1; k >= 0; --k) {
        const int64_t s = k * kSsdVjpChunk, e = std::min(L, s + kSsdVjpChunk);
        std::copy(saved.begin() + k * rows, saved.begin() + (k + 1) * rows, hs.begin());
        for (int64_t t = s; t < e; ++t) {  // hs[(t - s + 1) rows ...]: S_t's rows; dC_t
          const float* prev = hs.data() + (t - s) * rows;
          float* next = hs.data() + (t - s + 1) * rows;
          rows_at(t);
          const vw av = splat<vw>(decay[t]);
          const float* bt = bpad.data() + t * Np;
          float* out = sc + gbase + t * G * Np;
          for (int64_t v = 0; v < nv; ++v) {  // a vector of states at a time, four partial sums over rows
            const vw bv = load<vw>(bt + v * kW);
            vw acc[4] = {};
            for (int64_t p = 0; p < R; p += 4)
              for (int64_t q = 0; q < 4; ++q) {
                const int64_t o = (p + q) * Np + v * kW;
                const vw hv = av * load<vw>(prev + o) + splat<vw>(xr[p + q]) * bv;
                store(next + o, hv);
                acc[q] += splat<vw>(yr[p + q]) * hv;
              }
            store(out + v * kW, load<vw>(out + v * kW) + ((acc[0] + acc[1]) + (acc[2] + acc[3])));
          }
        }
        for (int64_t t = e - 1; t >= s; --t) {
          const float* prev = hs.data() + (t - s) * rows;  // S_{t-1}'s rows
          const float d = pd[base + t * H], a = decay[t];
          rows_at(t);
          const float *bt = bpad.data() + t * Np, *ct = cpad.data() + t * Np;
          float* out = sb + gbase + t * G * Np;
          const vw av = splat<vw>(a);
          for (int64_t p = 0; p < R; ++p) ev[p] = gsv[p] = splat<vw>(0.0f);
          for (int64_t v = 0; v < nv; ++v) {  // as above; each row's sums over states in lanes, summed after
            const vw bv = load<vw>(bt + v * kW), cv = load<vw>(ct + v * kW);
            vw acc[4] = {};
            for (int64_t p = 0; p < R; p += 4)
              for (int64_t q = 0; q < 4; ++q) {
                const int64_t o = (p + q) * Np + v * kW;
                const vw gv = load<vw>(adj.data() + o) + splat<vw>(yr[p + q]) * cv;
                acc[q] += splat<vw>(xr[p + q]) * gv;
                ev[p + q] += gv * bv;
                gsv[p + q] += gv * load<vw>(prev + o);
                store(adj.data() + o, av * gv);
              }
            store(out + v * kW, load<vw>(out + v * kW) + ((acc[0] + acc[1]) + (acc[2] + acc[3])));
          }
          float dd = 0.0f;
          vw gs = splat<vw>(0.0f);
          float* dxt = gx + (base + t * H) * P + r0;
          for (int64_t p = 0; p < w; ++p) {
            const float et = lane_total(ev[p]);
            dxt[p] = d * et;
            dd += xv[p] * et;
            gs += gsv[p];
          }
          const float q = a * lane_total(gs);
          sd[base + t * H] += dd + Ah * q;
          dA += d * q;
        }
      }
      sa[b * H + h] += dA;
    }
  });
  for (int64_t t = 0; t < nt; ++t) {
    const float* sb = sums.data() + static_cast<size_t>(t) * per_thread;
    const float *sc = sb + padded, *sd = sc + padded, *sa = sd + steps;
    for (size_t r = 0; r < static_cast<size_t>(B) * L * G; ++r)
      for (int64_t n = 0; n < N; ++n) {
        gb[r * N + n] += sb[r * Npad + n];
        gc[r * N + n] += sc[r * Npad + n];
      }
    for (size_t i = 0; i < steps; ++i) gd[i] += sd[i];
    for (int64_t i = 0; i < B * H; ++i) ga[i] += sa[i];
  }
  return ffi::Error::Success();
}

// NV vectors of a row's columns, of which `valid` lie inside it (the rest read as 0): u from src,
// or u into dst; lane is scratch of NV kW floats.
template <int NV>
inline void load_columns(const float* src, int64_t valid, float* lane, vw (&u)[NV]) {
  if (valid == NV * kW) {
    for (int j = 0; j < NV; ++j) u[j] = load<vw>(src + j * kW);
  } else {
    std::fill(lane, lane + NV * kW, 0.0f);
    std::memcpy(lane, src, sizeof(float) * valid);
    for (int j = 0; j < NV; ++j) u[j] = load<vw>(lane + j * kW);
  }
}
template <int NV>
inline void store_columns(const vw (&u)[NV], int64_t valid, float* lane, float* dst) {
  if (valid == NV * kW) {
    for (int j = 0; j < NV; ++j) store(dst + j * kW, u[j]);
  } else {
    for (int j = 0; j < NV; ++j) store(lane + j * kW, u[j]);
    std::memcpy(dst, lane, sizeof(float) * valid);
  }
}

constexpr int kDplrBlock = 4;  // vectors of value channels per pass over the sequence

// The value channels of d_v in blocks of up to kDplrBlock vectors, one run of the recurrence each:
// block(std::integral_constant<int, NV>{}, c0, cols) for the block from column c0 (cols columns
// of d_v remain from there).
template <typename Block>
inline void value_blocks(int64_t dv, Block&& block) {
  const int64_t pv = (dv + kW - 1) / kW;
  for (int64_t v0 = 0; v0 < pv; v0 += kDplrBlock) {
    const int64_t c0 = v0 * kW, cols = dv - c0;
    switch (std::min<int64_t>(kDplrBlock, pv - v0)) {
      case 1: block(std::integral_constant<int, 1>{}, c0, cols); break;
      case 2: block(std::integral_constant<int, 2>{}, c0, cols); break;
      case 3: block(std::integral_constant<int, 3>{}, c0, cols); break;
      default: block(std::integral_constant<int, 4>{}, c0, cols); break;
    }
  }
}

// The DPLR recurrence over a whole sequence for NV vectors of value channels (a compile-time
// count). Value channels evolve independently, so these columns of the state (its rows Z[d, :] =
// S[:, d] restricted to them, dk x NV vectors) stay in L1 for the whole sequence, and each step is
// one pass over them: with x_t = S_{t-1} a_t (LOW_RANK),
//   Z[d, :] = w_t[d] Z[d, :] + b_t[d] x_t + k_t[d] v_t,
//   o_t = sum_d q_t[d] Z[d, :] after the update (AFTER) or before it, plus bonus_t v_t,
//   x_{t+1} = sum_d a_{t+1}[d] Z[d, :]   (the next step's read, from the same pass).
// w: (L, w_stride) decays; q, k, a, b (L, dk); v, o: rows of dv floats from this block's first
// column, of which `cols` remain; bonus (L,) or null.
template <int NV, bool AFTER, bool LOW_RANK>
void dplr_columns(float* state, int64_t L, int64_t dk, int64_t dv, int64_t cols, const float* w, int64_t w_stride,
                  const float* q, const float* k, const float* a, const float* b, const float* bonus,
                  const float* v, float* o) {
  constexpr int64_t W = NV * kW;
  const int64_t valid = std::min<int64_t>(W, cols);  // the block's columns inside d_v
  std::fill(state, state + dk * W, 0.0f);
  vw x[NV];
  for (int j = 0; j < NV; ++j) x[j] = splat<vw>(0.0f);
  float lane[W];
  for (int64_t t = 0; t < L; ++t) {
    const float *wt = w + t * w_stride, *qt = q + t * dk, *kt = k + t * dk;
    const float* bt = LOW_RANK ? b + t * dk : nullptr;
    const float* an = (LOW_RANK && t + 1 < L) ? a + (t + 1) * dk : nullptr;
    vw u[NV], acc[NV], next[NV];
    load_columns<NV>(v + t * dv, valid, lane, u);
    for (int j = 0; j < NV; ++j) {
      acc[j] = bonus ? splat<vw>(bonus[t]) * u[j] : splat<vw>(0.0f);
      next[j] = splat<vw>(0.0f);
    }
    for (int64_t d = 0; d < dk; ++d) {
      float* row = state + d * W;
      const vw wd = splat<vw>(wt[d]), kd = splat<vw>(kt[d]), qd = splat<vw>(qt[d]);
      const vw bd = splat<vw>(LOW_RANK ? bt[d] : 0.0f), nd = splat<vw>(an ? an[d] : 0.0f);
      for (int j = 0; j < NV; ++j) {
        const vw old = load<vw>(row + j * kW);
        vw z = wd * old + kd * u[j];
        if (LOW_RANK) z += bd * x[j];
        store(row + j * kW, z);
        acc[j] += qd * (AFTER ? z : old);
        if (LOW_RANK) next[j] += nd * z;
      }
    }
    for (int j = 0; j < NV; ++j) x[j] = next[j];
    store_columns<NV>(acc, valid, lane, o + t * dv);
  }
}

template <int NV>
void dplr_columns_of(bool after, bool low_rank, float* state, int64_t L, int64_t dk, int64_t dv, int64_t cols,
                     const float* w, int64_t w_stride, const float* q, const float* k, const float* a,
                     const float* b, const float* bonus, const float* v, float* o) {
  if (after && low_rank) dplr_columns<NV, true, true>(state, L, dk, dv, cols, w, w_stride, q, k, a, b, bonus, v, o);
  else if (after) dplr_columns<NV, true, false>(state, L, dk, dv, cols, w, w_stride, q, k, a, b, bonus, v, o);
  else if (low_rank) dplr_columns<NV, false, true>(state, L, dk, dv, cols, w, w_stride, q, k, a, b, bonus, v, o);
  else dplr_columns<NV, false, false>(state, L, dk, dv, cols, w, w_stride, q, k, a, b, bonus, v, o);
}

// Floats of a DPLR state scratch (dplr_sequence) for dk key dimensions.
inline size_t dplr_state_size(int64_t dk) { return static_cast<size_t>(dk) * kDplrBlock * kW + kW; }

// One (batch, head) item's DPLR recurrence: the value channels in blocks of kDplrBlock vectors
// (dplr_columns), q, k, a, b (L, dk), w (L, w_stride) the decays (not their logs), v and o (L, dv).
void dplr_sequence(bool after, bool low_rank, float* state, int64_t L, int64_t dk, int64_t dv, const float* w,
                   int64_t w_stride, const float* q, const float* k, const float* a, const float* b,
                   const float* bonus, const float* v, float* o) {
  value_blocks(dv, [&](auto nv, int64_t c0, int64_t cols) {
    dplr_columns_of<decltype(nv)::value>(after, low_rank, state, L, dk, dv, cols, w, w_stride, q, k, a, b, bonus,
                                         v + c0, o + c0);
  });
}

// The gated delta rule over a whole sequence for NV vectors of value channels, the state's rows
// Z[d, :] kept as in dplr_columns: with x_t = sum_d k_t[d] Z_{t-1}[d, :] (from the previous pass),
//   Z[d, :] = a_t Z[d, :] + k_t[d] beta_t (v_t - a_t x_t),   o_t = sum_d q_t[d] Z[d, :].
// The DPLR form of the same step (w = a_t, a = -a_t k_t, b = beta_t k_t) spends a third product
// per state element. With AVX-512 the two sums run as two chains each (even and odd d): one chain
// of dk dependent FMAs per step would take as long as the step's arithmetic.
// decay, beta: (L,); q, k (L, dk); v, o: rows of dv floats from this block's first column, of
// which `cols` remain.
template <int NV>
void delta_columns(float* state, int64_t L, int64_t dk, int64_t dv, int64_t cols, const float* decay,
                   const float* beta, const float* q, const float* k, const float* v, float* o) {
  constexpr int64_t W = NV * kW;
  constexpr int kChains = kW == 16 ? 2 : 1;  // AVX2's 16 registers hold one set of sums
  const int64_t valid = std::min<int64_t>(W, cols);
  std::fill(state, state + dk * W, 0.0f);
  vw x[NV];
  for (int j = 0; j < NV; ++j) x[j] = splat<vw>(0.0f);
  float lane[W];
  for (int64_t t = 0; t < L; ++t) {
    // the last step's x is never read: its pass reads the last k row again instead of a row past L
    const float *qt = q + t * dk, *kt = k + t * dk, *kn = k + std::min<int64_t>(t + 1, L - 1) * dk;
    const vw at = splat<vw>(decay[t]), bt = splat<vw>(beta[t]);
    vw u[NV], acc[kChains][NV], next[kChains][NV];
    load_columns<NV>(v + t * dv, valid, lane, u);
    for (int j = 0; j < NV; ++j) {
      u[j] = bt * (u[j] - at * x[j]);
      for (int c = 0; c < kChains; ++c) acc[c][j] = next[c][j] = splat<vw>(0.0f);
    }
    const auto update = [&](int64_t d, int c) {  // state row d, its sums into chain c
      float* row = state + d * W;
      const vw kd = splat<vw>(kt[d]), qd = splat<vw>(qt[d]), nd = splat<vw>(kn[d]);
      for (int j = 0; j < NV; ++j) {
        const vw z = at * load<vw>(row + j * kW) + kd * u[j];
        store(row + j * kW, z);
        acc[c][j] += qd * z;
        next[c][j] += nd * z;
      }
    };
    int64_t d = 0;
    for (; d + kChains <= dk; d += kChains)
      for (int c = 0; c < kChains; ++c) update(d + c, c);
    for (; d < dk; ++d) update(d, 0);  // an odd dk's last row
    for (int j = 0; j < NV; ++j) {
      for (int c = 1; c < kChains; ++c) {
        acc[0][j] += acc[c][j];
        next[0][j] += next[c][j];
      }
      x[j] = next[0][j];
    }
    store_columns<NV>(acc[0], valid, lane, o + t * dv);
  }
}

// One (batch, value head)'s gated delta rule (delta_columns), the value channels in blocks of
// kDplrBlock vectors; state: dplr_state_size(dk) floats.
void delta_sequence(float* state, int64_t L, int64_t dk, int64_t dv, const float* decay, const float* beta,
                    const float* q, const float* k, const float* v, float* o) {
  value_blocks(dv, [&](auto nv, int64_t c0, int64_t cols) {
    delta_columns<decltype(nv)::value>(state, L, dk, dv, cols, decay, beta, q, k, v + c0, o + c0);
  });
}

// The DPLR recurrence (RWKV-5/6/7's and, rewritten, the gated delta rule's forward), one step per
// position: per batch b and head h, S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T with w_t =
// exp(log_w_t), read o_t = S_t q_t (after = 1) or S_{t-1} q_t + bonus_t v_t (after = 0). The
// low-rank term is present if has_ab, the bonus if has_bonus (absent operands may be any shape).
// The state is kept as its transpose, a row of d_v values per key dimension, in vectors (no lane
// sums), blocks of value channels one after another (dplr_columns); heads over the threads.
// The DPLR handlers' shared operands: q (B, H, L, dk), and k, log_w (and a, b if has_ab) of the
// same shape, bonus (B, H, L) if has_bonus.
bool dplr_operands(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& log_w,
                   const ffi::Buffer<ffi::F32>& a, const ffi::Buffer<ffi::F32>& b, const ffi::Buffer<ffi::F32>& bonus,
                   bool has_ab, bool has_bonus) {
  auto qd = q.dimensions(), bnd = bonus.dimensions();
  const auto same = [&](const ffi::Buffer<ffi::F32>& x) {
    auto xd = x.dimensions();
    return xd.size() == qd.size() && std::equal(xd.begin(), xd.end(), qd.begin());
  };
  return qd.size() == 4 && same(k) && same(log_w) && (!has_ab || (same(a) && same(b))) &&
         (!has_bonus || (bnd.size() == 3 && std::equal(bnd.begin(), bnd.end(), qd.begin())));
}

ffi::Error DplrScanImpl(ffi::ThreadPool xla,
                        ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                        ffi::Buffer<ffi::F32> log_w, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::F32> bonus, ffi::ResultBuffer<ffi::F32> out, int64_t threads,
                        int64_t has_ab, int64_t has_bonus, int64_t after) {
  auto qd = q.dimensions(), vd = v.dimensions();
  if (!dplr_operands(q, k, log_w, a, b, bonus, has_ab, has_bonus) || vd.size() != 4 || vd[0] != qd[0] ||
      vd[1] != qd[1] || vd[2] != qd[2])
    return ffi::Error::InvalidArgument("dplr_scan: inconsistent shapes (q, k, log_w, a, b (B, H, L, dk); "
                                       "v (B, H, L, dv); bonus (B, H, L))");
  const int64_t B = qd[0], H = qd[1], L = qd[2], dk = qd[3], dv = vd[3];
  if (B == 0 || H == 0 || L == 0 || dv == 0) return ffi::Error::Success();
  const int64_t items = B * H;
  const int64_t dkp = (dk + kW - 1) / kW * kW;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *pq = q.typed_data(), *pk = k.typed_data(), *pv_ = v.typed_data(), *pl = log_w.typed_data();
  const float *pa = a.typed_data(), *pb = b.typed_data(), *pbo = bonus.typed_data();
  float* po = out->typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> state(dplr_state_size(dk)), w(L * dkp + kW, 0.0f);
    for (int64_t item = t0; item < items; item += nt) {
      const size_t base = static_cast<size_t>(item) * L;  // (b, h, t = 0)
      for (int64_t t = 0; t < L; ++t) {  // every step's decays
        float* wt = w.data() + t * dkp;
        std::memcpy(wt, pl + (base + t) * dk, sizeof(float) * dk);
        for (int64_t d = 0; d < dkp; d += kW) store(wt + d, vexp_lanes<vw, vwi>(load<vw>(wt + d)));
      }
      dplr_sequence(after, has_ab, state.data(), L, dk, dv, w.data(), dkp, pq + base * dk, pk + base * dk,
                    has_ab ? pa + base * dk : nullptr, has_ab ? pb + base * dk : nullptr,
                    has_bonus ? pbo + base : nullptr, pv_ + base * dv, po + base * dv);
    }
  });
  return ffi::Error::Success();
}

// Positions between the stored states of dplr_scan_vjp's forward sweep: the reverse sweep runs the
// recurrence again from each stored state over its chunk, so it keeps (L / kVjpChunk + kVjpChunk)
// states per head instead of L.
constexpr int64_t kVjpChunk = 32;

// One step of the DPLR recurrence on the transposed state ST (dk rows of dv values), in place:
// ST[i] <- w[i] ST[i] + b[i] x + k[i] v with x = sum_i a[i] ST[i] (the state before the step; x
// scratch of dv floats, unused without the low-rank term).
inline void dplr_state_step(float* ST, int64_t dk, int64_t dv, const float* w, const float* k, const float* a,
                            const float* b, const float* v, float* x) {
  if (a) {
    std::fill(x, x + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dv; ++j) x[j] += a[i] * ST[i * dv + j];
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = ST + i * dv;
    const float wi = w[i], ki = k[i], bi = a ? b[i] : 0.0f;
    if (a)
      for (int64_t j = 0; j < dv; ++j) row[j] = wi * row[j] + bi * x[j] + ki * v[j];
    else
      for (int64_t j = 0; j < dv; ++j) row[j] = wi * row[j] + ki * v[j];
  }
}

// sum_j x[j] y[j] in 16 running sums (a sum in order would not vectorize).
inline float dot_n(const float* x, const float* y, int64_t n) {
  float acc[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[j + l] * y[j + l];
  float s = 0.0f;
  for (; j < n; ++j) s += x[j] * y[j];
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

// Reverse mode of dplr_scan for one (batch, head) item: given do_ (L, dv), the cotangents of q, k, v,
// log_w (and a, b, bonus where present). With A the adjoint of S_t (transposed as the state is),
// from the last position back: A += q_t do_t^T where o_t reads S_t; then dv_t = A k_t (+ bonus_t
// do_t), dk_t = A^T v_t, dlog_w_t = w_t * diag(S_{t-1}^T A), da_t = S_{t-1}^T (A b_t), db_t = A^T
// (S_{t-1} a_t); A <- A M_t^T (M_t = Diag(w_t) + a_t b_t^T); A += q_t do_t^T where o_t reads S_{t-1}.
// S_{t-1} comes from the states stored every kVjpChunk positions, run forward over the chunk.
void dplr_vjp_item(bool after, bool low_rank, bool has_bonus, int64_t L, int64_t dk, int64_t dv, const float* q,
                   const float* k, const float* v, const float* w, const float* a, const float* b,
                   const float* bonus, const float* do_, float* dq, float* dk_, float* dv_, float* dlw, float* da,
                   float* db, float* dbonus, std::vector<float>& stored, std::vector<float>& run,
                   std::vector<float>& adj, std::vector<float>& x, std::vector<float>& y) {
  const int64_t S = dk * dv, chunks = (L + kVjpChunk - 1) / kVjpChunk;
  stored.assign(chunks * S, 0.0f);
  run.resize((kVjpChunk + 1) * S);
  adj.assign(S, 0.0f);
  x.resize(dv);
  y.resize(dv);
  const float* no = nullptr;
  std::vector<float> state(S, 0.0f);
  for (int64_t t = 0; t < L; ++t) {  // the state entering each chunk
    if (t % kVjpChunk == 0) std::copy(state.begin(), state.end(), stored.begin() + t / kVjpChunk * S);
    dplr_state_step(state.data(), dk, dv, w + t * dk, k + t * dk, low_rank ? a + t * dk : no,
                    low_rank ? b + t * dk : no, v + t * dv, x.data());
  }
  float* A = adj.data();
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * kVjpChunk, t1 = std::min(L, t0 + kVjpChunk);
    std::copy(stored.begin() + c * S, stored.begin() + (c + 1) * S, run.begin());
    for (int64_t t = t0; t < t1; ++t) {  // run[t - t0 + 1]: S_t
      float* next = run.data() + (t - t0 + 1) * S;
      std::copy(next - S, next, next);
      dplr_state_step(next, dk, dv, w + t * dk, k + t * dk, low_rank ? a + t * dk : no, low_rank ? b + t * dk : no,
                      v + t * dv, x.data());
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const float* prev = run.data() + (t - t0) * S;  // S_{t-1}
      const float* read = after ? prev + S : prev;    // the state o_t reads
      const float *qt = q + t * dk, *kt = k + t * dk, *vt = v + t * dv, *wt = w + t * dk, *dot_ = do_ + t * dv;
      for (int64_t i = 0; i < dk; ++i) dq[t * dk + i] = dot_n(read + i * dv, dot_, dv);
      if (after)
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) A[i * dv + j] += qt[i] * dot_[j];
      float* dvt = dv_ + t * dv;
      for (int64_t j = 0; j < dv; ++j) dvt[j] = has_bonus ? bonus[t] * dot_[j] : 0.0f;
      for (int64_t i = 0; i < dk; ++i) {
        const float* Ai = A + i * dv;
        for (int64_t j = 0; j < dv; ++j) dvt[j] += kt[i] * Ai[j];
        dk_[t * dk + i] = dot_n(Ai, vt, dv);
        dlw[t * dk + i] = wt[i] * dot_n(prev + i * dv, Ai, dv);
      }
      if (has_bonus) dbonus[t] = dot_n(dot_, vt, dv);
      if (low_rank) {
        const float *at = a + t * dk, *bt = b + t * dk;
        std::fill(x.begin(), x.end(), 0.0f);
        std::fill(y.begin(), y.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) {
            x[j] += at[i] * prev[i * dv + j];
            y[j] += bt[i] * A[i * dv + j];
          }
        for (int64_t i = 0; i < dk; ++i) {
          da[t * dk + i] = dot_n(prev + i * dv, y.data(), dv);
          db[t * dk + i] = dot_n(A + i * dv, x.data(), dv);
        }
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) A[i * dv + j] = wt[i] * A[i * dv + j] + at[i] * y[j];
      } else {
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) A[i * dv + j] *= wt[i];
      }
      if (!after)
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) A[i * dv + j] += qt[i] * dot_[j];
    }
  }
}

// Reverse mode of dplr_scan (same operands and attributes, plus the outputs' cotangents do_): the
// cotangents of q, k, v, log_w, a, b and bonus, each shaped as its operand (the absent ones' as
// given). Heads over the threads.
ffi::Error DplrScanVjpImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> log_w, ffi::Buffer<ffi::F32> a,
                           ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> bonus, ffi::Buffer<ffi::F32> dout,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk_,
                           ffi::ResultBuffer<ffi::F32> dv_, ffi::ResultBuffer<ffi::F32> dlw,
                           ffi::ResultBuffer<ffi::F32> da, ffi::ResultBuffer<ffi::F32> db,
                           ffi::ResultBuffer<ffi::F32> dbonus, int64_t threads, int64_t has_ab, int64_t has_bonus,
                           int64_t after) {
  auto qd = q.dimensions(), vd = v.dimensions(), od = dout.dimensions();
  if (!dplr_operands(q, k, log_w, a, b, bonus, has_ab, has_bonus) || vd.size() != 4 || vd[0] != qd[0] ||
      vd[1] != qd[1] || vd[2] != qd[2] || od.size() != 4 || !std::equal(od.begin(), od.end(), vd.begin()))
    return ffi::Error::InvalidArgument("dplr_scan_vjp: inconsistent shapes (q, k, log_w, a, b (B, H, L, dk); "
                                       "v and the cotangent (B, H, L, dv); bonus (B, H, L))");
  const int64_t B = qd[0], H = qd[1], L = qd[2], dk = qd[3], dv = vd[3];
  const int64_t items = B * H;
  if (items == 0 || L == 0) return ffi::Error::Success();
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *pq = q.typed_data(), *pk = k.typed_data(), *pv = v.typed_data(), *pl = log_w.typed_data();
  const float *pa = a.typed_data(), *pb = b.typed_data(), *pbo = bonus.typed_data(), *pdo = dout.typed_data();
  float *gq = dq->typed_data(), *gk = dk_->typed_data(), *gv = dv_->typed_data(), *gl = dlw->typed_data();
  float *ga = da->typed_data(), *gb = db->typed_data(), *gbo = dbonus->typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> w(L * dk), stored, run, adj, x, y;
    for (int64_t item = t0; item < items; item += nt) {
      const size_t base = static_cast<size_t>(item) * L;
      for (int64_t i = 0; i < L * dk; ++i) w[i] = std::exp(pl[base * dk + i]);
      const size_t kb = base * dk, vb = base * dv;
      dplr_vjp_item(after, has_ab, has_bonus, L, dk, dv, pq + kb, pk + kb, pv + vb, w.data(),
                    has_ab ? pa + kb : nullptr, has_ab ? pb + kb : nullptr, has_bonus ? pbo + base : nullptr,
                    pdo + vb, gq + kb, gk + kb, gv + vb, gl + kb, has_ab ? ga + kb : nullptr,
                    has_ab ? gb + kb : nullptr, has_bonus ? gbo + base : nullptr, stored, run, adj, x, y);
    }
  });
  return ffi::Error::Success();
}

// The gated DeltaNet mixer between its projections (Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's;
// ops in the family's delta_parts and delta_inner), per batch b and value head h (key head g =
// h / (Hv / Hk); one work item per batch and key head):
//   u = SiLU(causal depthwise conv of the conv channels [q_g | k_g | v_h], read from x at xcols),
//   q = l2(u_q) dk^-1/2, k = l2(u_k), v = u_v (l2(u) = u rsqrt(sum u^2 + 1e-6)),
//   S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t (a_t = exp(log_a)),
//   y_t = w SiLU(z_t) o_t rsqrt(mean(o_t^2) + eps) (z read from z at zcols, w the norm weight).
// NaN: a NaN in u_k, u_v, beta or log_a makes y NaN from that step on, one in u_q that step's y;
// the recurrence runs on them replaced by 0, as the XLA path does (ops.zero_nan, ops.mark_nan).
// The recurrence: delta_sequence.
constexpr float kL2Eps = 1e-6f;  // FLA's / HF's l2norm

// Runs of consecutive columns: a gather of cols[0..n) as a few copies (a projection's heads are
// runs of d_k or d_v columns).
struct ColumnRun {
  int64_t dst, src, len;
};
void column_runs(const int32_t* cols, int64_t n, std::vector<ColumnRun>& runs) {
  runs.clear();
  for (int64_t c = 0; c < n; ++c) {
    if (!runs.empty() && runs.back().src + runs.back().len == cols[c]) ++runs.back().len;
    else runs.push_back({c, cols[c], 1});
  }
}
inline void gather_row(const float* x, const std::vector<ColumnRun>& runs, float* out) {
  for (const ColumnRun& r : runs) {  // short runs: a loop, not memcpy's call
    int64_t i = 0;
    for (; i + kW <= r.len; i += kW) store(out + r.dst + i, load<vw>(x + r.src + i));
    for (; i < r.len; ++i) out[r.dst + i] = x[r.src + i];
  }
}

// sum x[i]^2 over n floats, in vectors (NaN if and only if x holds a NaN).
inline float sum_squares(const float* x, int64_t n) {
  vw acc = splat<vw>(0.0f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vw xi = load<vw>(x + i);
    acc += xi * xi;
  }
  float s = lane_total(acc);  // the lanes summed pairwise: log2(kW) dependent adds, not kW
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// 1 / x for x >= 1 (or +inf, or NaN): the hardware's reciprocal estimate and one Newton step,
// within about 1 ulp; a divide costs several times more and SiLU takes one per element.
inline vw recip_ge1(vw x) {
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
  const vw r = (vw)_mm512_rcp14_ps((__m512)x);
#else
  const vw r = (vw)_mm256_rcp_ps((__m256)x);
#endif
  const vw y = r * (splat<vw>(2.0f) - x * r);
  return x == splat<vw>(__builtin_inff()) ? splat<vw>(0.0f) : y;  // inf * 0 would be NaN
#else  // no estimate instruction to start from (a -march without AVX)
  return splat<vw>(1.0f) / x;
#endif
}

// x sigmoid(x) = x / (1 + exp(-x)).
inline vw silu(vw x) { return x * recip_ge1(splat<vw>(1.0f) + vexp_lanes<vw, vwi>(-x)); }

// SiLU(conv) of the rows K - 1 .. K - 2 + L of g (row stride gs; rows 0 .. K - 2 zero: the causal
// padding) into u (L rows of stride gs): wt (K, gs) the filters by tap, bias (gs) or null.
void conv_silu(const float* g, int64_t L, int64_t K, const float* wt, const float* bias, float* u, int64_t gs) {
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t c = 0; c < gs; c += kW) {
      vw acc = splat<vw>(0.0f);
      for (int64_t s = 0; s < K; ++s) acc += load<vw>(g + (t + s) * gs + c) * load<vw>(wt + s * gs + c);
      if (bias) acc += load<vw>(bias + c);
      store(u + t * gs + c, silu(acc));
    }
  }
}

// x rsqrt(sum x^2 + eps) times scale into out (n floats), NaN entries 0; whether x held a NaN.
inline bool l2_row(const float* x, int64_t n, float scale, float* out) {
  const float ss = sum_squares(x, n), r = 1.0f / std::sqrt(ss + kL2Eps);
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] * r;
    out[i] = y == y ? y * scale : 0.0f;
  }
  return std::isnan(ss);
}

// out = x with NaN entries 0 (n floats); whether x held a NaN.
inline bool copy_zeroing_nan(const float* x, int64_t n, float* out) {
  vwi seen = vwi{};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vw xi = load<vw>(x + i);
    const vwi ok = xi == xi;
    store(out + i, ok ? xi : splat<vw>(0.0f));
    seen |= ~ok;
  }
  bool bad = false;
  for (int j = 0; j < kW; ++j) bad |= seen[j] != 0;
  for (; i < n; ++i) {
    bad |= x[i] != x[i];
    out[i] = x[i] == x[i] ? x[i] : 0.0f;
  }
  return bad;
}

ffi::Error GatedDeltaNetImpl(ffi::ThreadPool xla, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> xcols,
                             ffi::Buffer<ffi::F32> conv_w, ffi::Buffer<ffi::F32> conv_b, ffi::Buffer<ffi::F32> z,
                             ffi::Buffer<ffi::S32> zcols, ffi::Buffer<ffi::F32> log_a, ffi::Buffer<ffi::F32> beta,
                             ffi::Buffer<ffi::F32> norm_w, ffi::ResultBuffer<ffi::F32> out, int64_t threads,
                             int64_t key_heads, int64_t key_dim, float eps) {
  auto xd = x.dimensions(), zd = z.dimensions(), ad = log_a.dimensions(), wd = conv_w.dimensions();
  const int64_t nx = static_cast<int64_t>(xcols.element_count()), nz = static_cast<int64_t>(zcols.element_count());
  if (xd.size() != 3 || zd.size() != 3 || ad.size() != 3 || wd.size() != 2 || zd[0] != xd[0] || zd[1] != xd[1] ||
      ad[0] != xd[0] || ad[1] != xd[1] || beta.dimensions().size() != 3 ||
      !std::equal(ad.begin(), ad.end(), beta.dimensions().begin()) || wd[0] != nx || wd[1] < 1 || key_heads < 1 ||
      key_dim < 1 || ad[2] < 1 || ad[2] % key_heads || nz % ad[2] || nx != 2 * key_heads * key_dim + nz ||
      static_cast<int64_t>(norm_w.element_count()) != nz / ad[2] ||
      (conv_b.element_count() != 0 && static_cast<int64_t>(conv_b.element_count()) != nx))
    return ffi::Error::InvalidArgument(
        "gated_delta_net: inconsistent shapes (x (B, L, Px), xcols (2 Hk dk + Hv dv,), conv_w (2 Hk dk + Hv dv, "
        "K), conv_b (2 Hk dk + Hv dv,) or empty, z (B, L, Pz), zcols (Hv dv,), log_a and beta (B, L, Hv), "
        "norm_w (dv,), Hv a multiple of Hk)");
  const int64_t B = xd[0], L = xd[1], px = xd[2], pz = zd[2], Hv = ad[2], Hk = key_heads, dk = key_dim;
  const int64_t dv = nz / Hv, K = wd[1], rep = Hv / Hk;
  const int32_t *xc = xcols.typed_data(), *zc = zcols.typed_data();
  for (int64_t c = 0; c < nx; ++c)
    if (xc[c] < 0 || xc[c] >= px)
      return ffi::Error::InvalidArgument("gated_delta_net: xcols holds a column outside x (" +
                                         std::to_string(xc[c]) + ", x has " + std::to_string(px) + ")");
  for (int64_t c = 0; c < nz; ++c)
    if (zc[c] < 0 || zc[c] >= pz)
      return ffi::Error::InvalidArgument("gated_delta_net: zcols holds a column outside z (" +
                                         std::to_string(zc[c]) + ", z has " + std::to_string(pz) + ")");
  if (B == 0 || L == 0 || dv == 0) return ffi::Error::Success();
  // One item per (batch, key head): its q and k channels go through the conv and the norms once
  // for the rep value heads that read them.
  const int64_t n = 2 * dk + rep * dv, gs = (n + kW - 1) / kW * kW;
  const int64_t dvp = (dv + kW - 1) / kW * kW;
  const int64_t items = B * Hk, nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *px_ = x.typed_data(), *pz_ = z.typed_data(), *pw = conv_w.typed_data(), *pla = log_a.typed_data();
  const float *pbe = beta.typed_data(), *pnw = norm_w.typed_data();
  const float* pcb = conv_b.element_count() ? conv_b.typed_data() : nullptr;
  float* py = out->typed_data();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  std::vector<float> nw(dvp, 0.0f);  // the norm weights, zero past dv
  std::copy(pnw, pnw + dv, nw.begin());
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> g((L + K - 1) * gs, 0.0f), u(L * gs), q(L * dk), k(L * dk), v(L * dv), decays(L), betas(L);
    std::vector<float> o(L * dv + kW);  // the output's vector reads run up to kW - 1 floats past the last row
    std::vector<float> wt(K * gs, 0.0f), bias(gs, 0.0f), state(dplr_state_size(dk)), gate(dvp, 0.0f);
    std::vector<int32_t> cols(n), xcol(n);
    std::vector<ColumnRun> xruns, zruns;
    std::vector<char> q_bad(L), k_bad(L), bad(L);
    for (int64_t item = t0; item < items; item += nt) {
      const int64_t b = item / Hk, kh = item % Hk;
      for (int64_t i = 0; i < dk; ++i) {  // the item's conv channels: q_g, k_g, then v of its value heads
        cols[i] = static_cast<int32_t>(kh * dk + i);
        cols[dk + i] = static_cast<int32_t>(Hk * dk + kh * dk + i);
      }
      for (int64_t i = 0; i < rep * dv; ++i) cols[2 * dk + i] = static_cast<int32_t>(2 * Hk * dk + kh * rep * dv + i);
      for (int64_t c = 0; c < n; ++c) {  // wt's and bias' last gs - n entries stay 0
        xcol[c] = xc[cols[c]];
        for (int64_t s = 0; s < K; ++s) wt[s * gs + c] = pw[cols[c] * K + s];
        if (pcb) bias[c] = pcb[cols[c]];
      }
      column_runs(xcol.data(), n, xruns);
      // g's first K - 1 rows and last gs - n columns stay 0
      for (int64_t t = 0; t < L; ++t) gather_row(px_ + (b * L + t) * px, xruns, g.data() + (t + K - 1) * gs);
      conv_silu(g.data(), L, K, wt.data(), pcb ? bias.data() : nullptr, u.data(), gs);
      for (int64_t t = 0; t < L; ++t) {
        const float* ut = u.data() + t * gs;
        q_bad[t] = l2_row(ut, dk, q_scale, q.data() + t * dk);
        k_bad[t] = l2_row(ut + dk, dk, 1.0f, k.data() + t * dk);
      }
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t h = kh * rep + r;
        const float *lat = pla + b * L * Hv + h, *bet = pbe + b * L * Hv + h;
        bool state_bad = false;
        for (int64_t t = 0; t < L; ++t) {
          const bool v_bad = copy_zeroing_nan(u.data() + t * gs + 2 * dk + r * dv, dv, v.data() + t * dv);
          const float la = lat[t * Hv], be = bet[t * Hv];
          state_bad |= k_bad[t] || v_bad || std::isnan(la) || std::isnan(be);
          bad[t] = state_bad || q_bad[t];
          decays[t] = std::exp(std::isnan(la) ? 0.0f : la);
          betas[t] = std::isnan(be) ? 0.0f : be;
        }
        delta_sequence(state.data(), L, dk, dv, decays.data(), betas.data(), q.data(), k.data(), v.data(), o.data());
        column_runs(zc + h * dv, dv, zruns);
        const float* zb = pz_ + b * L * pz;
        // The output row and the gate's inputs kAhead rows on are prefetched: rows nz and pz floats
        // apart escape the hardware prefetchers (at Qwen3-Next's benchmark layer this loop took 171
        // us per thread without, 128 with).
        constexpr int64_t kAhead = 8;
        for (int64_t t = 0; t < L; ++t) {
          float* yt = py + (b * L + t) * nz + h * dv;
          if (t + kAhead < L)
            for (int64_t i = 0; i < dv; i += 16) {  // 16 floats: a cache line
              __builtin_prefetch(yt + kAhead * nz + i, 1);
              __builtin_prefetch(zb + (t + kAhead) * pz + zc[h * dv] + i);
            }
          if (bad[t]) {
            std::fill(yt, yt + dv, __builtin_nanf(""));
            continue;
          }
          const float* ot = o.data() + t * dv;
          const vw inv = splat<vw>(1.0f / std::sqrt(sum_squares(ot, dv) / static_cast<float>(dv) + eps));
          gather_row(zb + t * pz, zruns, gate.data());  // gate's last dvp - dv floats stay 0
          for (int64_t i = 0; i < dvp; i += kW) {
            const vw y = load<vw>(nw.data() + i) * inv * silu(load<vw>(gate.data() + i)) * load<vw>(ot + i);
            if (i + kW <= dv) {
              store(yt + i, y);
            } else {
              float lane[kW];
              store(lane, y);
              std::memcpy(yt + i, lane, sizeof(float) * (dv - i));
            }
          }
        }
      }
    }
  });
  return ffi::Error::Success();
}

// The matrix of a recurrence with a decay per key dimension (ops.dplr_matrix without a, b:
// RWKV-5/6), w = exp(log_w), one (batch, head) item at a time, each element written once:
//   after:  M[i,j] = sum_n q[i,n] k[j,n] prod_{t=j+1..i} w[t,n]     (j <= i),
//   else:   M[i,j] = sum_n q[i,n] k[j,n] prod_{t=j+1..i-1} w[t,n]   (j < i),
// plus bonus[i] on the diagonal. The "else" rows are "after" rows one step back: row i is row
// i - 1 with the query q[i]. Both run the Mamba-1 kernel's chunked product (prepare's layout,
// diagonal_block, chunk_rows); the decay between two chunks is a product of whole-chunk decays,
// each <= 1 (no differences of exponents: a NaN reaches only the chunks after it).

// The per-step decays and the chunk factors of one item into s (the layout prepare writes),
// and each chunk's whole decay into tot ([J][n], n padded to Np with 1). Rows past L: decay 1,
// q = k = 0; e holds Lp * Np floats.
void prepare_decays(const float* q, const float* k, const float* lw, bool after, const Dims& d, Scratch& s,
                    float* e, float* tot) {
  const int64_t L = d.L, N = d.N, nc = (L + kQ - 1) / kQ, Lp = nc * kQ, Np = (N + kQ - 1) / kQ * kQ;
  float *dAT = s.dAT.data(), *qd = s.qd.data(), *qp = s.qp.data(), *kp = s.kp.data(), *kdT = s.kdT.data();
  for (int64_t t = 0; t < Lp; ++t) {
    float* et = e + t * Np;
    std::fill(et, et + Np, 0.0f);
    if (t < L) std::memcpy(et, lw + t * N, sizeof(float) * N);
    for (int64_t n = 0; n < Np; n += kW) store(et + n, vexp_lanes<vw, vwi>(load<vw>(et + n)));
    const int64_t tq = after ? t : t + 1;  // the query this row reads
    for (int64_t n = 0; n < N; ++n) {
      qp[t * N + n] = tq < L ? q[tq * N + n] : 0.0f;
      kp[t * N + n] = t < L ? k[t * N + n] : 0.0f;
    }
  }
  for (int64_t J = 0; J < nc; ++J) {
    const int64_t J0 = J * kQ;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t jj = 0; jj < kQ; ++jj) dAT[(J * N + n) * kQ + jj] = e[(J0 + jj) * Np + n];
    running_products(J, N, e + J0 * Np, Np, 1, qp, kp, qd, kdT, tot + J * Np);
    std::fill(tot + J * Np + N, tot + (J + 1) * Np, 1.0f);
  }
}

// The decays over the chunks strictly between J and row chunk I, for every J < I, into c.mid.
void between_decays(int64_t I, const Dims& d, const float* tot, ChunkState& c) {
  const int64_t Np = (d.N + kQ - 1) / kQ * kQ;
  for (int64_t n = 0; n < Np; n += kQ) {
    v16 run = splat(1.0f);
    for (int64_t J = I - 1; J >= 0; --J) {
      store(c.mid.data() + J * Np + n, run);
      run *= load(tot + J * Np + n);
    }
  }
}

// One item's L x L matrix into out (row-major). t holds kQ rows of Lp + kQ floats.
void decay_matrix_item(const float* q, const float* k, const float* lw, const float* bonus, bool after,
                       const Dims& d, Scratch& s, ChunkState& c, float* e, float* tot, float* t, float* out) {
  const int64_t L = d.L, nc = (L + kQ - 1) / kQ, ts = nc * kQ + kQ, shift = after ? 0 : 1;
  prepare_decays(q, k, lw, after, d, s, e, tot);
  const Channel none{};  // diagonal_block: no per-channel diagonal (the bonus is added below)
  if (!after) {  // row 0 holds only the diagonal
    std::memset(out, 0, sizeof(float) * L);
    out[0] = bonus ? bonus[0] : 0.0f;
  }
  for (int64_t I = 0; I < nc; ++I) {
    const int64_t I0 = I * kQ, r0 = I0 + shift, rows = std::min(kQ, L - r0);
    if (rows <= 0) break;
    between_decays(I, d, tot, c);
    diagonal_block(none, I, d, s, c);
    // Whole chunks go straight into the output; what they write right of the diagonal is
    // cleared below, in the same rows.
    const bool direct = r0 + kQ <= L && I0 + kQ <= L;
    chunk_rows(I, 0, I + 1, d, s, c, direct ? out + r0 * L : t, direct ? L : ts);
    for (int64_t ii = 0; ii < rows; ++ii) {
      const int64_t i = r0 + ii, keep = I0 + ii + 1;  // columns j <= i (after) or j < i
      float* o = out + i * L;
      if (!direct) std::memcpy(o, t + ii * ts, sizeof(float) * keep);
      std::memset(o + keep, 0, sizeof(float) * (L - keep));
      if (!after) o[i] = bonus ? bonus[i] : 0.0f;
      else if (bonus) o[i] += bonus[i];
    }
  }
}

ffi::Error DecayMatrixImpl(ffi::ThreadPool xla,
                           ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> log_w,
                           ffi::Buffer<ffi::F32> bonus, ffi::ResultBuffer<ffi::F32> out, int64_t threads,
                           int64_t has_bonus, int64_t after, int64_t huge_pages) {
  auto qd = q.dimensions();
  if (!dplr_operands(q, k, log_w, q, q, bonus, false, has_bonus))
    return ffi::Error::InvalidArgument("decay_matrix: inconsistent shapes (q, k, log_w (B, H, L, dk); "
                                       "bonus (B, H, L))");
  const int64_t B = qd[0], H = qd[1], L = qd[2], N = qd[3];
  if (N > kMaxState) return ffi::Error::InvalidArgument("decay_matrix: needs dk <= 64");
  if (B == 0 || H == 0 || L == 0) return ffi::Error::Success();
  const Dims d{B, H, L, N, 1};
  const int64_t items = B * H, nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const int64_t nc = (L + kQ - 1) / kQ, Lp = nc * kQ, Np = (N + kQ - 1) / kQ * kQ;
  const size_t LL = static_cast<size_t>(L) * L;
  float* po = out->typed_data();
  if (huge_pages) advise_huge(po, LL * items * sizeof(float));
  const float *pq = q.typed_data(), *pk = k.typed_data(), *pl = log_w.typed_data(), *pb = bonus.typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    Scratch s(d);
    ChunkState c(d, nc);
    std::vector<float> e(Lp * Np), tot(nc * Np), t(kQ * (Lp + kQ));
    for (int64_t item = t0; item < items; item += nt) {
      const size_t base = static_cast<size_t>(item) * L * N;
      decay_matrix_item(pq + base, pk + base, pl + base, has_bonus ? pb + static_cast<size_t>(item) * L : nullptr,
                        after, d, s, c, e.data(), tot.data(), t.data(), po + item * LL);
    }
  });
  return ffi::Error::Success();
}

// The matrix of the DPLR recurrence with its low-rank term (ops.dplr_matrix with a, b: RWKV-7; the
// gated delta rule written as one), w = exp(log_w), P_t = Diag(w_t) + a_t b_t^T:
//   M[i,j] = k_j^T P_{j+1} ... P_i q_i      (after; j <= i),
//   M[i,j] = k_j^T P_{j+1} ... P_{i-1} q_i  (else; j < i),
// plus bonus[i] on the diagonal. kLowRankRows rows at a time, one per lane, each row's vector taken
// back through the steps: r = q_i from step i (else i - 1) on, then at each step t down to 0,
// M[i,t] = k_t . r and r <- P_t r = w_t r + a_t (b_t . r). A lane before its row starts holds 0,
// and its start is a select, so a NaN or inf of a later step never reaches it. The recurrence is
// the forward's (dplr_scan) run on query vectors: no chunk solves, O(L^2 dk) per head.

// Rows per block of lowrank_rows: two 16-float vectors of lanes, whose dependent chains (each
// step's dot products, then its update) interleave, and kAcc partial sums per dot product.
constexpr int64_t kLowRankRows = 2 * kQ;
constexpr int64_t kAcc = 2;

// The kLowRankRows x L block of rows whose vectors start at steps T0 .. T0 + kLowRankRows - 1, as
// columns into col ([t][lane]); R holds dk * kLowRankRows floats ([d][lane]). One pass over R per
// step: the update by step t + 1 and the dot products with step t's k and b.
template <bool LOW_RANK>
void lowrank_rows(int64_t T0, int64_t L, int64_t dk, int64_t shift, const float* q, const float* k,
                  const float* w, const float* a, const float* b, float* R, float* col) {
  constexpr int64_t NV = kLowRankRows / kW, S = kLowRankRows;
  vw lane[NV], s[NV];
  for (int64_t v = 0; v < NV; ++v) {
    for (int64_t l = 0; l < kW; ++l) lane[v][l] = static_cast<float>(v * kW + l);
    s[v] = splat<vw>(0.0f);
  }
  std::fill(R, R + dk * S, 0.0f);
  const int64_t top = std::min(L - 1, T0 + S - 1);
  for (int64_t t = top; t >= 0; --t) {
    const float *kt = k + t * dk, *bt = LOW_RANK ? b + t * dk : nullptr;
    // The previous step's transition (none before the first): r <- w r + a s.
    const bool update = t < top;
    const float *wn = update ? w + (t + 1) * dk : w, *an = LOW_RANK && update ? a + (t + 1) * dk : nullptr;
    const int64_t row = t + shift;  // the row whose vector starts here, if in this block
    const bool starts = t >= T0 && row < L;
    const float* qr = starts ? q + row * dk : nullptr;
    const vw start = splat<vw>(static_cast<float>(t - T0));
    vw c[kAcc][NV], sn[kAcc][NV];
#pragma GCC unroll 4
    for (int64_t u = 0; u < kAcc; ++u)
#pragma GCC unroll 4
      for (int64_t v = 0; v < NV; ++v) c[u][v] = sn[u][v] = splat<vw>(0.0f);
    const auto pass = [&](int64_t d, int64_t u) {
#pragma GCC unroll 4
      for (int64_t v = 0; v < NV; ++v) {
        float* p = R + d * S + v * kW;
        vw r = load<vw>(p);
        if (update) {
          r = splat<vw>(wn[d]) * r;
          if (LOW_RANK) r += splat<vw>(an[d]) * s[v];
        }
        if (starts) r = lane[v] == start ? splat<vw>(qr[d]) : r;
        store(p, r);
        c[u][v] += splat<vw>(kt[d]) * r;
        if (LOW_RANK) sn[u][v] += splat<vw>(bt[d]) * r;
      }
    };
    int64_t d = 0;
    for (; d + kAcc <= dk; d += kAcc)
#pragma GCC unroll 4
      for (int64_t u = 0; u < kAcc; ++u) pass(d + u, u);
    for (; d < dk; ++d) pass(d, 0);
#pragma GCC unroll 4
    for (int64_t v = 0; v < NV; ++v) {
#pragma GCC unroll 4
      for (int64_t u = 1; u < kAcc; ++u) {
        c[0][v] += c[u][v];
        sn[0][v] += sn[u][v];
      }
      store(col + t * S + v * kW, c[0][v]);
      s[v] = sn[0][v];
    }
  }
}

ffi::Error LowRankMatrixImpl(ffi::ThreadPool xla,
                             ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> log_w,
                             ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> bonus,
                             ffi::ResultBuffer<ffi::F32> out, int64_t threads, int64_t has_ab, int64_t has_bonus,
                             int64_t after, int64_t huge_pages) {
  auto qd = q.dimensions();
  if (!dplr_operands(q, k, log_w, a, b, bonus, has_ab, has_bonus))
    return ffi::Error::InvalidArgument("lowrank_matrix: inconsistent shapes (q, k, log_w, a, b (B, H, L, dk); "
                                       "bonus (B, H, L))");
  const int64_t B = qd[0], H = qd[1], L = qd[2], dk = qd[3];
  if (B == 0 || H == 0 || L == 0) return ffi::Error::Success();
  const int64_t items = B * H, nb = (L + kLowRankRows - 1) / kLowRankRows, shift = after ? 0 : 1;
  const size_t LL = static_cast<size_t>(L) * L, per = static_cast<size_t>(L) * dk;
  float* po = out->typed_data();
  if (huge_pages) advise_huge(po, LL * items * sizeof(float));
  const float *pq = q.typed_data(), *pk = k.typed_data(), *pl = log_w.typed_data(), *pa = a.typed_data(),
              *pb = b.typed_data(), *pbo = bonus.typed_data();
  std::vector<float> w(per * items);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items * nb));
  run_threads(xla, nt, [&](int64_t t0) {  // every step's decays, dk padded to a whole vector per row
    std::vector<float> row(dk + kW);
    for (int64_t p = t0; p < items * L; p += nt) {
      std::fill(row.begin(), row.end(), 0.0f);
      std::memcpy(row.data(), pl + p * dk, sizeof(float) * dk);
      for (int64_t d = 0; d < dk; d += kW) store(row.data() + d, vexp_lanes<vw, vwi>(load<vw>(row.data() + d)));
      std::memcpy(w.data() + p * dk, row.data(), sizeof(float) * dk);
    }
  });
  run_threads(xla, nt, [&](int64_t t0) {
    std::vector<float> R(dk * kLowRankRows), col(nb * kLowRankRows * kLowRankRows);
    for (int64_t p = t0; p < items * nb; p += nt) {
      // The last blocks first (the costliest: their rows reach back the furthest), so the
      // threads finish together.
      const int64_t item = p % items, blk = nb - 1 - p / items, T0 = blk * kLowRankRows;
      const size_t base = static_cast<size_t>(item) * per;
      const float *qi = pq + base, *ki = pk + base, *wi = w.data() + base;
      float* oi = po + item * LL;
      if (has_ab)
        lowrank_rows<true>(T0, L, dk, shift, qi, ki, wi, pa + base, pb + base, R.data(), col.data());
      else
        lowrank_rows<false>(T0, L, dk, shift, qi, ki, wi, nullptr, nullptr, R.data(), col.data());
      const float* boi = has_bonus ? pbo + static_cast<size_t>(item) * L : nullptr;
      for (int64_t l = 0; l < kLowRankRows; ++l) {
        const int64_t i = T0 + l + shift, keep = T0 + l + 1;  // columns j <= i (after) or j < i
        if (i >= L) break;
        float* o = oi + i * L;
        for (int64_t j = 0; j < keep; ++j) o[j] = col[j * kLowRankRows + l];
        std::memset(o + keep, 0, sizeof(float) * (L - keep));
        if (!after) o[i] = boi ? boi[i] : 0.0f;
        else if (boi) o[i] += boi[i];
      }
      if (!after && blk == 0) {  // row 0 holds only the diagonal
        std::memset(oi, 0, sizeof(float) * L);
        oi[0] = boi ? boi[0] : 0.0f;
      }
    }
  });
  return ffi::Error::Success();
}

// RWKV-4's WKV recurrence (the time mix's forward, not its operator): per channel, HF's CPU path
// in the same order, with the state num, den scaled by e^{-m} (m the running max of the exponents):
//   p = max(m, u + k_t),  y_t = (e^{m-p} num + e^{u+k_t-p} v_t) / (e^{m-p} den + e^{u+k_t-p}),
//   p' = max(m + w, k_t), num = e^{m+w-p'} num + e^{k_t-p'} v_t, den = e^{m+w-p'} den + e^{k_t-p'},
//   m = p'.
// m is kept in double: in float, m + w rounds w to m's ulp (4e-6 at m = 60, w = -1e-3: 0.4% of
// the decay, every step), an error that adds up along the sequence (7e-4 of the output after 4,096
// steps against the definition in float64); the exponentials and num, den stay float.
// Sixteen channels per item, in vectors of kD (a double vector as wide as the machine's); a last
// block of fewer channels runs on zero lanes that are not written back.
constexpr float kWkvEmptyLogMax = -1e38f;  // ops.wkv.EMPTY_LOG_MAX: the empty state's m, finite
constexpr int64_t kD = kW / 2;
typedef double vd __attribute__((vector_size(kD * 8)));
typedef float vh __attribute__((vector_size(kD * 4)));
typedef int32_t vhi __attribute__((vector_size(kD * 4)));

inline vh wkv_exp(vd x) { return vexp_lanes<vh, vhi>(__builtin_convertvector(x, vh)); }

ffi::Error WkvScanImpl(ffi::ThreadPool xla,
                       ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  auto wd = w.dimensions(), ud = u.dimensions(), kd = k.dimensions(), vdims = v.dimensions();
  if (wd.size() != 1 || ud.size() != 1 || kd.size() != 3 || vdims.size() != 3 ||
      !std::equal(kd.begin(), kd.end(), vdims.begin()) || wd[0] != kd[2] || ud[0] != kd[2])
    return ffi::Error::InvalidArgument("wkv_scan: inconsistent shapes (w, u (A,); k, v (B, L, A))");
  constexpr int64_t nv = kQ / kD;
  const int64_t B = kd[0], L = kd[1], A = kd[2];
  const int64_t blocks = (A + kQ - 1) / kQ, items = B * blocks;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const float *pw = w.typed_data(), *pu = u.typed_data(), *pk = k.typed_data(), *pv = v.typed_data();
  float* py = y->typed_data();
  run_threads(xla, nt, [&](int64_t t0) {
    float kin[kQ], vin[kQ], out[kQ], win[kQ], uin[kQ];
    for (int64_t p = t0; p < items; p += nt) {
      const int64_t b = p / blocks, c0 = (p % blocks) * kQ, n = std::min<int64_t>(kQ, A - c0);
      const auto part = [&](const float* src, float* lane) {  // 16 channels from c0, zeros past A
        if (n < kQ) std::fill(lane, lane + kQ, 0.0f);
        std::memcpy(lane, src, sizeof(float) * n);
      };
      part(pw + c0, win);
      part(pu + c0, uin);
      vd ww[nv], uu[nv], m[nv];
      vh num[nv], den[nv];
      for (int64_t h = 0; h < nv; ++h) {
        ww[h] = __builtin_convertvector(load<vh>(win + h * kD), vd);
        uu[h] = __builtin_convertvector(load<vh>(uin + h * kD), vd);
        m[h] = __builtin_convertvector(splat<vh>(kWkvEmptyLogMax), vd);
        num[h] = den[h] = splat<vh>(0.0f);
      }
      for (int64_t t = 0; t < L; ++t) {
        const size_t row = (static_cast<size_t>(b) * L + t) * A + c0;
        const float *kr = pk + row, *vr = pv + row;
        if (n < kQ) {
          part(kr, kin);
          part(vr, vin);
          kr = kin;
          vr = vin;
        }
        float* yr = n < kQ ? out : py + row;
        for (int64_t h = 0; h < nv; ++h) {
          const vh vt = load<vh>(vr + h * kD);
          const vd kt = __builtin_convertvector(load<vh>(kr + h * kD), vd);
          const vd now = uu[h] + kt;
          const vd top = m[h] > now ? m[h] : now;
          const vh e1 = wkv_exp(m[h] - top), e2 = wkv_exp(now - top);
          store(yr + h * kD, (e1 * num[h] + e2 * vt) / (e1 * den[h] + e2));
          const vd past = m[h] + ww[h];
          const vd top2 = past > kt ? past : kt;
          const vh f1 = wkv_exp(past - top2), f2 = wkv_exp(kt - top2);
          num[h] = f1 * num[h] + f2 * vt;
          den[h] = f1 * den[h] + f2;
          m[h] = top2;
        }
        if (n < kQ) std::memcpy(py + row, out, sizeof(float) * n);
      }
    }
  });
  return ffi::Error::Success();
}

// The operands both handlers share, in order: the factors of H.
template <typename Binding>
auto bind_factors(Binding b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::F32>>()  // q (B, L, N)
      .template Arg<ffi::Buffer<ffi::F32>>()       // k (B, L, N)
      .template Arg<ffi::Buffer<ffi::F32>>()       // A (C, N)
      .template Arg<ffi::Buffer<ffi::F32>>()       // dt (B, C, L)
      .template Arg<ffi::Buffer<ffi::F32>>()       // left (B, C, L)
      .template Arg<ffi::Buffer<ffi::F32>>()       // right (B, C, L)
      .template Arg<ffi::Buffer<ffi::F32>>()       // diag (B, C, L)
      .template Arg<ffi::Buffer<ffi::F32>>()       // conv w (C, K)
      .template Arg<ffi::Buffer<ffi::S32>>();      // document ids (B, L)
}

// The flags both handlers share, after their own operands.
template <typename Binding>
auto bind_flags(Binding b) {
  return std::move(b).template Attr<int64_t>("has_left")
      .template Attr<int64_t>("has_right")
      .template Attr<int64_t>("has_diag")
      .template Attr<int64_t>("has_seg")
      .template Attr<int64_t>("threads");
}

}  // namespace

// The handlers. A build in parts (cache.build_library: the file compiled once per part, side by
// side, then linked) defines IA_PARTIAL and IA_<symbol> for each handler its part holds; each
// part compiles only the code its handlers reach. A whole build defines neither.

#if !IA_PARTIAL || IA_IaStateDecayDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaStateDecayDense, StateDecayDenseImpl,
    bind_flags(bind_factors(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                   .Ret<ffi::Buffer<ffi::F32>>())  // out (B, C, L, L)
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaStateDecayReduce
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaStateDecayReduce, StateDecayReduceImpl,
    bind_flags(bind_factors(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                   .Arg<ffi::Buffer<ffi::F32>>()    // query weights (B, C, L)
                   .Arg<ffi::Buffer<ffi::F32>>()    // key weights (B, C, L)
                   .Ret<ffi::Buffer<ffi::F32>>())   // out (B, L, L)
        .Attr<int64_t>("mode"));
#endif

#if !IA_PARTIAL || IA_IaHeadMatrixDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaHeadMatrixDense, HeadMatrixDenseImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // head matrices (B, H, L, L)
        .Arg<ffi::Buffer<ffi::S32>>()   // channel -> head matrix (n,)
        .Arg<ffi::Buffer<ffi::F32>>()   // left (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // right (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // diag (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // conv w (n, K)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, >= offset + n, L, L)
        .Attr<int64_t>("has_left")
        .Attr<int64_t>("has_right")
        .Attr<int64_t>("has_diag")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages")
        .Attr<int64_t>("offset"));
#endif

#if !IA_PARTIAL || IA_IaHeadMatrixReduce
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaHeadMatrixReduce, HeadMatrixReduceImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // head matrices (B, H, L, L)
        .Arg<ffi::Buffer<ffi::S32>>()   // channel -> head matrix (n,), -1: left out
        .Arg<ffi::Buffer<ffi::F32>>()   // left (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // right (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // diag (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // conv w (n, K)
        .Arg<ffi::Buffer<ffi::F32>>()   // query weights (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // key weights (B, n, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // accumulator (B, L, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, L, L): accumulator + the sum
        .Attr<int64_t>("has_left")
        .Attr<int64_t>("has_right")
        .Attr<int64_t>("has_diag")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("mode"));
#endif

#if !IA_PARTIAL || IA_IaRwkvDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaRwkvDense, RwkvDenseImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // w (C,)
        .Arg<ffi::Buffer<ffi::F32>>()   // u (C,)
        .Arg<ffi::Buffer<ffi::F32>>()   // gate (B, C, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, C, L, L)
        .Attr<int64_t>("has_gate")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaRwkvReduce
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaRwkvReduce, RwkvReduceImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // w (C,)
        .Arg<ffi::Buffer<ffi::F32>>()   // u (C,)
        .Arg<ffi::Buffer<ffi::F32>>()   // gate (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // query weights (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // key weights (B, C, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, L, L)
        .Attr<int64_t>("has_gate")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("mode"));
#endif

#if !IA_PARTIAL || IA_IaShortConvDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaShortConvDense, ShortConvDenseImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // w (C, K)
        .Arg<ffi::Buffer<ffi::F32>>()   // left (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()   // right (B, C, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, C, L, L)
        .Attr<int64_t>("has_right")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaAttentionDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaAttentionDense, AttentionDenseImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q (B, n, L, d), scaled
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, KV, L, d)
        .Arg<ffi::Buffer<ffi::S32>>()   // query head -> key head (n,)
        .Arg<ffi::Buffer<ffi::S32>>()   // document ids (B, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, n, L, L)
        .Attr<int64_t>("window")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages")
        .Attr<int64_t>("stream"));
#endif

#if !IA_PARTIAL || IA_IaLasDense
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaLasDense, LasDenseImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q (B, n, L, d), scaled
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, H, L, d)
        .Arg<ffi::Buffer<ffi::S32>>()   // each query head's key head (n,)
        .Arg<ffi::Buffer<ffi::F32>>()   // ELD rates alpha (n,)
        .Arg<ffi::Buffer<ffi::F32>>()   // ALiBi slopes (n,)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, n, L, L)
        .Attr<int64_t>("has_alpha")
        .Attr<int64_t>("has_slope")
        .Attr<int64_t>("pool")
        .Attr<int64_t>("lo")
        .Attr<int64_t>("chunk")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages")
        .Attr<int64_t>("stream"));
#endif

#if !IA_PARTIAL || IA_IaAttentionForward
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaAttentionForward, AttentionForwardImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q (B, n, L, d), scaled
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, KV, L, d)
        .Arg<ffi::Buffer<ffi::F32>>()   // v (B, KV, L, e)
        .Arg<ffi::Buffer<ffi::S32>>()   // query head -> key head (n,)
        .Arg<ffi::Buffer<ffi::S32>>()   // document ids (B, L)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (B, n, L, e)
        .Attr<int64_t>("window")
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaGroupedFromTokens
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaGroupedFromTokens, GroupedFromTokensImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x (T, K): the tokens
        .Arg<ffi::Buffer<ffi::S32>>()   // col (T, k): each copy's column in the packs
        .Arg<ffi::Buffer<ffi::S32>>()   // the expert of each pack (P,), -1 for none
        .Arg<ffi::Buffer<ffi::F32>>()   // w (E, R, K)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (P, R, 32)
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaGroupedToTokens
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaGroupedToTokens, GroupedToTokensImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // h (P, K, 32): packs of one expert's copies, as columns
        .Arg<ffi::Buffer<ffi::S32>>()   // col (T, k): each copy's column in the packs
        .Arg<ffi::Buffer<ffi::F32>>()   // weights (T, k): each copy's routing weight
        .Arg<ffi::Buffer<ffi::S32>>()   // the expert of each pack (P,), -1 for none
        .Arg<ffi::Buffer<ffi::F32>>()   // w (E, R, K)
        .Ret<ffi::Buffer<ffi::F32>>()   // out (T, R)
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaFill
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaFill, FillImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Ret<ffi::Buffer<ffi::F32>>()   // out, any shape
        .Attr<float>("value")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaPlaceChannels
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaPlaceChannels, PlaceChannelsImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // src (B, m, L, L)
        .Arg<ffi::Buffer<ffi::S32>>()   // source channel of each slot (k,)
        .Arg<ffi::Buffer<ffi::F32>>()   // into (B, total, L, L), aliased to out
        .Ret<ffi::Buffer<ffi::F32>>()   // out
        .Attr<int64_t>("offset")
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaCopy
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaCopy, CopyImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>()   // x
        .Ret<ffi::Buffer<ffi::F32>>());  // out, x's shape
#endif

// The selective scan's operands: u, dt (B, L, C), A transposed per batch row (B, N, C), Bm, Cm (B, L, N).
#define IA_SCAN_ARGS                                                                                           \
  Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()                        \
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()

#if !IA_PARTIAL || IA_IaSelectiveScan
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaSelectiveScan, SelectiveScanImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().IA_SCAN_ARGS
        .Ret<ffi::Buffer<ffi::F32>>()   // y (B, L, C)
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaSelectiveScanVjp
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaSelectiveScanVjp, SelectiveScanVjpImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().IA_SCAN_ARGS
        .Arg<ffi::Buffer<ffi::F32>>()   // the outputs' cotangent (B, L, C)
        .Ret<ffi::Buffer<ffi::F32>>()   // du
        .Ret<ffi::Buffer<ffi::F32>>()   // ddt
        .Ret<ffi::Buffer<ffi::F32>>()   // dA^T (B, N, C)
        .Ret<ffi::Buffer<ffi::F32>>()   // dBm
        .Ret<ffi::Buffer<ffi::F32>>()   // dCm
        .Attr<int64_t>("threads"));
#endif

// The SSD's operands: x (B, L, H, P), dt (B, L, H), A per batch row (B, 1, H), Bm, Cm (B, L, G, N).
#define IA_SSD_ARGS                                                                                            \
  Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()                        \
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()

#if !IA_PARTIAL || IA_IaSsdScan
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaSsdScan, SsdScanImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .IA_SSD_ARGS
        .Ret<ffi::Buffer<ffi::F32>>()   // y (B, L, H, P)
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaSsdScanVjp
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaSsdScanVjp, SsdScanVjpImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().IA_SSD_ARGS
        .Arg<ffi::Buffer<ffi::F32>>()   // the outputs' cotangent (B, L, H, P)
        .Ret<ffi::Buffer<ffi::F32>>()   // dx
        .Ret<ffi::Buffer<ffi::F32>>()   // ddt
        .Ret<ffi::Buffer<ffi::F32>>()   // dA (B, 1, H)
        .Ret<ffi::Buffer<ffi::F32>>()   // dBm
        .Ret<ffi::Buffer<ffi::F32>>()   // dCm
        .Attr<int64_t>("threads"));
#endif

// The DPLR recurrence's operands: q, k (B, H, L, dk), v (B, H, L, dv), the log decays (B, H, L, dk),
// a, b (B, H, L, dk; read if has_ab), bonus (B, H, L; read if has_bonus).
#define IA_DPLR_ARGS                                                                                           \
  Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()                        \
      .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::F32>>()
#define IA_DPLR_ATTRS Attr<int64_t>("threads").Attr<int64_t>("has_ab").Attr<int64_t>("has_bonus").Attr<int64_t>("after")

#if !IA_PARTIAL || IA_IaDplrScan
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaDplrScan, DplrScanImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().IA_DPLR_ARGS
        .Ret<ffi::Buffer<ffi::F32>>()   // o (B, H, L, dv)
        .IA_DPLR_ATTRS);
#endif

#if !IA_PARTIAL || IA_IaDplrScanVjp
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaDplrScanVjp, DplrScanVjpImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().IA_DPLR_ARGS
        .Arg<ffi::Buffer<ffi::F32>>()   // the outputs' cotangent (B, H, L, dv)
        .Ret<ffi::Buffer<ffi::F32>>()   // dq
        .Ret<ffi::Buffer<ffi::F32>>()   // dk
        .Ret<ffi::Buffer<ffi::F32>>()   // dv
        .Ret<ffi::Buffer<ffi::F32>>()   // dlog_w
        .Ret<ffi::Buffer<ffi::F32>>()   // da (as a)
        .Ret<ffi::Buffer<ffi::F32>>()   // db (as b)
        .Ret<ffi::Buffer<ffi::F32>>()   // dbonus (as bonus)
        .IA_DPLR_ATTRS);
#endif

#if !IA_PARTIAL || IA_IaWkvScan
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaWkvScan, WkvScanImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // w (A,)
        .Arg<ffi::Buffer<ffi::F32>>()   // u (A,)
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, L, A)
        .Arg<ffi::Buffer<ffi::F32>>()   // v (B, L, A)
        .Ret<ffi::Buffer<ffi::F32>>()   // y (B, L, A)
        .Attr<int64_t>("threads"));
#endif

#if !IA_PARTIAL || IA_IaDecayMatrix
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaDecayMatrix, DecayMatrixImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // log decays (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // bonus (B, H, L), if has_bonus
        .Ret<ffi::Buffer<ffi::F32>>()   // M (B, H, L, L)
        .Attr<int64_t>("threads")
        .Attr<int64_t>("has_bonus")
        .Attr<int64_t>("after")
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaLowRankMatrix
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaLowRankMatrix, LowRankMatrixImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // q (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // k (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // log decays (B, H, L, dk)
        .Arg<ffi::Buffer<ffi::F32>>()   // a (B, H, L, dk), if has_ab
        .Arg<ffi::Buffer<ffi::F32>>()   // b (B, H, L, dk), if has_ab
        .Arg<ffi::Buffer<ffi::F32>>()   // bonus (B, H, L), if has_bonus
        .Ret<ffi::Buffer<ffi::F32>>()   // M (B, H, L, L)
        .Attr<int64_t>("threads")
        .Attr<int64_t>("has_ab")
        .Attr<int64_t>("has_bonus")
        .Attr<int64_t>("after")
        .Attr<int64_t>("huge_pages"));
#endif

#if !IA_PARTIAL || IA_IaGatedDeltaNet
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaGatedDeltaNet, GatedDeltaNetImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::F32>>()   // x (B, L, Px): the conv's inputs among its columns
        .Arg<ffi::Buffer<ffi::S32>>()   // xcols (2 Hk dk + Hv dv,): conv channel -> column of x
        .Arg<ffi::Buffer<ffi::F32>>()   // conv_w (2 Hk dk + Hv dv, K)
        .Arg<ffi::Buffer<ffi::F32>>()   // conv_b (2 Hk dk + Hv dv,) or empty
        .Arg<ffi::Buffer<ffi::F32>>()   // z (B, L, Pz): the output gate's inputs among its columns
        .Arg<ffi::Buffer<ffi::S32>>()   // zcols (Hv dv,): gate channel -> column of z
        .Arg<ffi::Buffer<ffi::F32>>()   // log_a (B, L, Hv)
        .Arg<ffi::Buffer<ffi::F32>>()   // beta (B, L, Hv)
        .Arg<ffi::Buffer<ffi::F32>>()   // norm_w (dv,)
        .Ret<ffi::Buffer<ffi::F32>>()   // y (B, L, Hv dv)
        .Attr<int64_t>("threads")
        .Attr<int64_t>("key_heads")
        .Attr<int64_t>("key_dim")
        .Attr<float>("eps"));
#endif
