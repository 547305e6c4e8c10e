// Fused CPU kernel for the Mamba-1 operator (StateDecayCore.dense), an XLA FFI handler.
//
// H[b,c] = (diag(l) K diag(r) + diag(d)) M, with
//   K[i,j] = sum_n q[i,n] k[j,n] prod_{t=j+1..i} exp(A[n] dt[t])   (i >= j, else 0)
// and M the banded causal conv matrix of the channel's filter w (K taps), optionally
// zeroed between different documents (seg). A rank-one scalar decay (Griffin's RG-LRU)
// is the case N = 1, q = k = 1, A = -1, dt = -log a.
//
// Every output element is written exactly once, row by row; a row is first formed in a
// small scratch buffer (L1-resident), then convolved into the output. The decay uses
// the chunked factorisation of the XLA path: for i in chunk I and j in an earlier
// chunk J, prod_{t=j+1..i} = [prefix of I up to i] * [chunks strictly between] *
// [suffix of J after j], each a product of factors <= 1 (no growth, no overflow).
// Inside a chunk the decay is a running product down each column.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQ = 16;  // chunk length = one vector of 16 floats

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 splat(float x) { return v16{} + x; }

// exp of 16 floats: Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, and a degree-6
// polynomial for exp(r) (the Cephes expf coefficients): about 1 ulp. Results below
// FLT_MIN are flushed to 0, as XLA's CPU backend does.
inline v16 vexp(v16 x) {
  const v16 lo = splat(-87.33654f), hi = splat(88.3762626f);
  const v16 xc = x < lo ? lo : (x > hi ? hi : x);
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 kf = (xc * splat(1.44269504088896341f) + magic) - magic;
  v16 r = xc - kf * splat(0.693359375f);
  r = r - kf * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v16i bits = (__builtin_convertvector(kf, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v16 y = p * scale;
  return x < lo ? splat(0.0f) : (x > hi ? splat(__builtin_inff()) : y);
}

struct Dims {
  int64_t B, C, L, N, K;
};

struct Scratch {
  std::vector<float> Ap, dAT, qd, qp, kp, kdT, tot, mid, row;
  std::vector<int32_t> seg;
  explicit Scratch(const Dims& d) {
    const int64_t nc = (d.L + kQ - 1) / kQ, Lp = nc * kQ, Np = (d.N + kQ - 1) / kQ * kQ;
    Ap.resize(Np);
    dAT.resize(Lp * d.N);
    qd.resize(Lp * d.N);
    qp.resize(Lp * d.N);
    kp.resize(Lp * d.N);
    kdT.resize(Lp * d.N);
    tot.resize(nc);
    mid.resize(nc * Np);
    row.resize(Lp + 2 * kQ + d.K);
    seg.resize(Lp);
  }
};

// One (batch, channel) operator into out (L x L, row-major).
void one_channel(const float* q, const float* k, const float* A, const float* dt,
                 const float* left, const float* right, const float* diag, const float* w,
                 const int32_t* seg, const Dims& d, float* out, Scratch& s) {
  const int64_t L = d.L, N = d.N, K = d.K;
  const int64_t nc = (L + kQ - 1) / kQ, Np = (N + kQ - 1) / kQ * kQ;
  float* dAT = s.dAT.data();  // [J][n][jj]: exp(A[n] dt[J*Q + jj])
  float* qd = s.qd.data();    // [i][n]: q l times the decay from the chunk start through i
  float* qp = s.qp.data();    // [i][n]: q l
  float* kp = s.kp.data();    // [j][n]: k r
  float* kdT = s.kdT.data();  // [J][n][jj]: k r times the decay after j to the chunk end
  float* mid = s.mid.data();  // [J][n]: decay over the chunks strictly between J and I
  float* row = s.row.data();
  float* Ap = s.Ap.data();
  for (int64_t n = 0; n < Np; ++n) Ap[n] = n < N ? A[n] : 0.0f;
  int32_t* segp = s.seg.data();  // document ids, padded (-1) to whole chunks
  if (seg)
    for (int64_t t = 0; t < nc * kQ; ++t) segp[t] = t < L ? seg[t] : -1;

  // Per-chunk factors (padding past L: dt 0, q k 0).
  for (int64_t J = 0; J < nc; ++J) {
    const int64_t J0 = J * kQ;
    float dtv[kQ];
    float acc = 0.0f;
    for (int64_t jj = 0; jj < kQ; ++jj) {
      dtv[jj] = J0 + jj < L ? dt[J0 + jj] : 0.0f;
      acc += dtv[jj];
    }
    s.tot[J] = acc;
    const v16 dtj = load(dtv);
    for (int64_t n = 0; n < N; ++n) store(dAT + (J * N + n) * kQ, vexp(dtj * splat(A[n])));
    for (int64_t t = J0; t < J0 + kQ; ++t) {
      const bool in = t < L;
      const float lt = in ? (left ? left[t] : 1.0f) : 0.0f;
      const float rt = in ? (right ? right[t] : 1.0f) : 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        qp[t * N + n] = in ? q[t * N + n] * lt : 0.0f;
        kp[t * N + n] = in ? k[t * N + n] * rt : 0.0f;
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      const float* a = dAT + (J * N + n) * kQ;
      float p = 1.0f;
      for (int64_t jj = 0; jj < kQ; ++jj) {
        p *= a[jj];
        qd[(J0 + jj) * N + n] = qp[(J0 + jj) * N + n] * p;
      }
      p = 1.0f;
      for (int64_t jj = kQ - 1; jj >= 0; --jj) {
        kdT[(J * N + n) * kQ + jj] = kp[(J0 + jj) * N + n] * p;
        p *= a[jj];
      }
    }
  }

  v16 G[64];  // diagonal-block state per n (N <= 64, checked by the caller)
  for (int64_t I = 0; I < nc; ++I) {
    const int64_t I0 = I * kQ, rows = std::min(kQ, L - I0);
    float between = 0.0f;
    for (int64_t J = I - 1; J >= 0; --J) {
      for (int64_t n = 0; n < Np; n += kQ)
        store(mid + J * Np + n, vexp(load(Ap + n) * splat(between)));
      between += s.tot[J];
    }
    for (int64_t n = 0; n < N; ++n) G[n] = splat(0.0f);
    for (int64_t ii = 0; ii < rows; ++ii) {
      const int64_t i = I0 + ii;
      const float* qi = qd + i * N;
      // Blocks left of the diagonal: row i of qd diag(mid_J) kd_J^T.
      for (int64_t J = 0; J < I; ++J) {
        v16 acc = splat(0.0f);
        const float* kt = kdT + J * N * kQ;
        const float* m = mid + J * Np;
        for (int64_t n = 0; n < N; ++n) acc += splat(qi[n] * m[n]) * load(kt + n * kQ);
        store(row + J * kQ, acc);
      }
      // The diagonal block: G_n[jj] = k r[j, n] prod_{t=j+1..i} dA[t, n], for jj <= ii.
      v16 acc = splat(0.0f);
      for (int64_t n = 0; n < N; ++n) {
        G[n] *= splat(dAT[(I * N + n) * kQ + ii]);
        G[n][ii] = kp[i * N + n];
        acc += splat(qp[i * N + n]) * G[n];
      }
      if (diag) acc[ii] += diag[i];
      store(row + I0, acc);
      store(row + I0 + kQ, splat(0.0f));  // H is 0 right of i (conv reads up to K-1 past)
      // (H M)[i, j] = sum_s H[i, j + s] w[K-1-s], a vector of 16 columns at a time.
      float* o = out + i * L;
      for (int64_t J = 0; J <= I; ++J) {
        v16 y = splat(0.0f);
        for (int64_t t = 0; t < K; ++t) y += splat(w[K - 1 - t]) * load(row + J * kQ + t);
        if (seg) {  // packed documents: the conv must not reach across a document start
          v16i sj;
          std::memcpy(&sj, segp + J * kQ, sizeof(sj));
          y = sj == segp[i] ? y : splat(0.0f);
        }
        if (J * kQ + kQ <= L) {
          store(o + J * kQ, y);
        } else {
          for (int64_t jj = 0; J * kQ + jj < L; ++jj) o[J * kQ + jj] = y[jj];
        }
      }
      if ((I + 1) * kQ < L) std::memset(o + (I + 1) * kQ, 0, sizeof(float) * (L - (I + 1) * kQ));
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

ffi::Error StateDecayDenseImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> A, ffi::Buffer<ffi::F32> dt,
                               ffi::Buffer<ffi::F32> left, ffi::Buffer<ffi::F32> right,
                               ffi::Buffer<ffi::F32> diag, ffi::Buffer<ffi::F32> w,
                               ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                               int64_t has_left, int64_t has_right, int64_t has_diag,
                               int64_t has_seg, int64_t threads,
                               int64_t huge_pages) {
  auto qd = q.dimensions(), ad = A.dimensions(), td = dt.dimensions(), wd = w.dimensions();
  if (qd.size() != 3 || ad.size() != 2 || td.size() != 3 || wd.size() != 2)
    return ffi::Error::InvalidArgument("state_decay_dense: expected q (B,L,N), A (C,N), dt (B,C,L), w (C,K)");
  Dims d{qd[0], ad[0], qd[1], qd[2], wd[1]};
  if (td[0] != d.B || td[1] != d.C || td[2] != d.L || ad[1] != d.N || wd[0] != d.C ||
      k.dimensions()[0] != d.B || k.dimensions()[1] != d.L || k.dimensions()[2] != d.N)
    return ffi::Error::InvalidArgument("state_decay_dense: inconsistent shapes");
  if (d.N > 64 || d.K > kQ)
    return ffi::Error::InvalidArgument("state_decay_dense: needs state size <= 64 and conv width <= 16");
  if (d.L == 0 || d.C == 0 || d.B == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  const size_t LL = static_cast<size_t>(d.L) * d.L;
  if (huge_pages) advise_huge(o, LL * d.B * d.C * sizeof(float));
  const int64_t pairs = d.B * d.C;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, pairs));
  auto work = [&](int64_t t0) {
    Scratch s(d);
    for (int64_t p = t0; p < pairs; p += nt) {
      const int64_t b = p / d.C, c = p % d.C;
      const size_t cl = static_cast<size_t>(p) * d.L;
      one_channel(q.typed_data() + b * d.L * d.N, k.typed_data() + b * d.L * d.N,
                  A.typed_data() + c * d.N, dt.typed_data() + cl,
                  has_left ? left.typed_data() + cl : nullptr,
                  has_right ? right.typed_data() + cl : nullptr,
                  has_diag ? diag.typed_data() + cl : nullptr, w.typed_data() + c * d.K,
                  has_seg ? seg.typed_data() + b * d.L : nullptr, d,
                  o + static_cast<size_t>(p) * LL, s);
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < nt; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    IaStateDecayDense, StateDecayDenseImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>()  // q (B, L, N)
        .Arg<ffi::Buffer<ffi::F32>>()  // k (B, L, N)
        .Arg<ffi::Buffer<ffi::F32>>()  // A (C, N)
        .Arg<ffi::Buffer<ffi::F32>>()  // dt (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()  // left (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()  // right (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()  // diag (B, C, L)
        .Arg<ffi::Buffer<ffi::F32>>()  // conv w (C, K)
        .Arg<ffi::Buffer<ffi::S32>>()  // document ids (B, L)
        .Ret<ffi::Buffer<ffi::F32>>()  // out (B, C, L, L)
        .Attr<int64_t>("has_left")
        .Attr<int64_t>("has_right")
        .Attr<int64_t>("has_diag")
        .Attr<int64_t>("has_seg")
        .Attr<int64_t>("threads")
        .Attr<int64_t>("huge_pages"));
