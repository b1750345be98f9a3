// PET's per-atom multi-head attention, its derivative and the derivative of that
// derivative, each in one pass that keeps an atom's [t, t] score blocks in cache.
//
// Built and loaded by petfunc/ops/attention_library.py (plain C++, no torch headers, so
// that it builds in a second or two). All tensors are contiguous:
//   qkv   [A, t, 3, H, e]  queries, keys, values of every grid slot (unscaled q)
//   bias  [A, t]           additive attention bias of each key, shared by all heads
//   out   [A, t, H, e]     attention output (and every cotangent of that shape)
// with A atoms, t slots per atom, H heads of width e, and the score of query i and
// key j in head h being  c * q_i . k_j + bias_j.
//
// The derivatives, per atom and head, with P = softmax(S) row-wise, O = P V and
// G the cotangent of O:
//   dP = G V^T,  r_i = sum_j P_ij dP_ij,  dS = P * (dP - r)
//   dQ = c dS K,  dK = c dS^T Q,  dV = P^T G,  dbias_j = sum_{h, i} dS_ij
// The second derivative is the vector-Jacobian product of that map
// (qkv, bias, G) -> (dqkv, dbias) with cotangents (A_, B_, C_) on (dQ, dK, dV)
// and beta on dbias:
//   W = c (A_ K^T + Q B_^T) + 1 beta^T   (the cotangent of dS)
//   u_i = sum_j W_ij P_ij,   dPbar = P * (W - u)
//   Pbar = W * (dP - r) - u dP + G C_^T,   Sbar = P * (Pbar - rowsum(P * Pbar))
//   gQ = c (Sbar K + dS B_),  gK = c (Sbar^T Q + dS^T A_),  gV = dPbar^T G
//   gG = dPbar V + P C_,  gbias_j = sum_{h, i} Sbar_ij
// Each thread works on one atom and head at a time: the [t, t] blocks of that head
// (a few of them, 16 kB each for t = 64 in float32) are computed, used and
// dropped in cache; nothing of that shape reaches memory.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Bytes per vector: one AVX-512 register where the CPU has them, else 32 (AVX2).
// A 64-byte vector on AVX2 is two registers, and the product loops' 8
// accumulators of them spill (the kernels ran 9-10x slower).
#if defined(__AVX512F__)
#define PETFUNC_VBYTES 64
#else
#define PETFUNC_VBYTES 32
#endif

namespace {

// exp(x) for x <= 0 (scores minus their row maximum), one vector at a time
// (GCC's vector extensions: the auto-vectorizer left the scalar loop scalar):
// 2^k * exp(r) with |r| <= ln(2)/2 and a Taylor polynomial
// (degree 7 for float, 12 for double: truncation below the type's round-off).
// Arguments below -87 (float) or -708 (double) give 0 (next to the row's maximum
// term 1; padded keys have bias -1e30). Returns the sum of the row.
template <typename T> struct Vec;
template <> struct Vec<float> {
    typedef float V __attribute__((vector_size(PETFUNC_VBYTES)));
    typedef int32_t I __attribute__((vector_size(PETFUNC_VBYTES)));
};
template <> struct Vec<double> {
    typedef double V __attribute__((vector_size(PETFUNC_VBYTES)));
    typedef int64_t I __attribute__((vector_size(PETFUNC_VBYTES)));
};

// sum and maximum of a vector's lanes (AVX-512's reductions where available)
template <typename T, typename V>
inline T reduce_sum(V v) {
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
    else return _mm512_reduce_add_pd(reinterpret_cast<__m512d&>(v));
#else
    constexpr int n = sizeof(V) / sizeof(T);
    T a[n];
    __builtin_memcpy(a, &v, sizeof(V));
    for (int w = n / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) a[l] += a[l + w];
    return a[0];
#endif
}

template <typename T, typename V>
inline T reduce_max(V v) {
#if defined(__AVX512F__)
    if constexpr (sizeof(T) == 4) return _mm512_reduce_max_ps(reinterpret_cast<__m512&>(v));
    else return _mm512_reduce_max_pd(reinterpret_cast<__m512d&>(v));
#else
    constexpr int n = sizeof(V) / sizeof(T);
    T a[n];
    __builtin_memcpy(a, &v, sizeof(V));
    for (int w = n / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) a[l] = a[l + w] > a[l] ? a[l + w] : a[l];
    return a[0];
#endif
}

// sum_j a[j] b[j] over n (a multiple of the vector length) entries
template <typename T>
inline T dot_row(const T* a, const T* b, int64_t n) {
    typedef typename Vec<T>::V V;
    constexpr int64_t vl = PETFUNC_VBYTES / sizeof(T);
    V acc = {}, x, y;
    for (int64_t jb = 0; jb < n; jb += vl) {
        __builtin_memcpy(&x, a + jb, sizeof(V));
        __builtin_memcpy(&y, b + jb, sizeof(V));
        acc += x * y;
    }
    return reduce_sum<T>(acc);
}

template <typename T>
inline T exp_row(T* x, int64_t n) {
    // n is a multiple of the vector length (rows are padded); GCC's vector
    // extensions, as the auto-vectorizer leaves this loop scalar
    typedef typename Vec<T>::V V;
    typedef typename Vec<T>::I I;
    constexpr int64_t vl = PETFUNC_VBYTES / sizeof(T);
    constexpr bool single = sizeof(T) == 4;
    const T lo = single ? T(-87.0) : T(-708.0);
    const T log2e = T(1.4426950408889634);
    const T ln2_hi = T(0.693145751953125);
    const T ln2_lo = T(1.4286068203094172321e-6);
    // k = round(v log2(e)) without a float-to-integer conversion (AVX2 has none
    // from double to int64, and the compiler made the double loop scalar): adding
    // 1.5 * 2^23 (float) or 1.5 * 2^52 (double), plus the exponent bias, rounds to
    // an integer whose low mantissa bits are k + bias, the exponent field of 2^k
    const T shift = single ? T(12582912.0 + 127.0) : T(6755399441055744.0 + 1023.0);
    V total = {};
    for (int64_t jb = 0; jb < n; jb += vl) {
        V v0;
        __builtin_memcpy(&v0, x + jb, sizeof(V));
        V v = v0 > lo ? v0 : lo;
        V y = v * log2e + shift;
        V k = y - shift;
        V r = (v - k * ln2_hi) - k * ln2_lo;
        V p;
        if constexpr (single) {
            p = T(1) + r * (T(1) + r * (T(1.0 / 2) + r * (T(1.0 / 6) + r * (T(1.0 / 24) + r * (T(1.0 / 120) +
                r * (T(1.0 / 720) + r * T(1.0 / 5040)))))));
        } else {
            p = T(1) + r * (T(1) + r * (T(1.0 / 2) + r * (T(1.0 / 6) + r * (T(1.0 / 24) + r * (T(1.0 / 120) +
                r * (T(1.0 / 720) + r * (T(1.0 / 5040) + r * (T(1.0 / 40320) + r * (T(1.0 / 362880) +
                r * (T(1.0 / 3628800) + r * (T(1.0 / 39916800) + r * T(1.0 / 479001600))))))))))));
        }
        I bits;
        __builtin_memcpy(&bits, &y, sizeof(V));
        bits <<= (single ? 23 : 52);
        V out = p * reinterpret_cast<V&>(bits);
        out = v0 > lo ? out : T(0);
        total += out;
        __builtin_memcpy(x + jb, &out, sizeof(V));
    }
    return reduce_sum<T>(total);
}

// Vector length in elements (PETFUNC_VBYTES bytes). Keys are padded to a multiple of
// it (tp), query rows to a multiple of 4 (tr <= tp): every loop over keys is whole
// vectors and every product works on 4 rows at a time.
template <typename T>
constexpr int64_t VL = PETFUNC_VBYTES / sizeof(T);
constexpr int64_t ROWS = 4;

inline int64_t round_up(int64_t t, int64_t m) { return (t + m - 1) / m * m; }

// Small dense products on one head's blocks, E the head width (compile time) or 0
// (runtime width e). Row-major; X, Y are [tr, e], YT is [e, tp], P is [tr, tp].

// out[i, j] = sum_d X[i, d] YT[d, j] (out [tr, tp]): X Y^T. Blocks of 4 rows by
// 2 key vectors: 8 independent multiply-add chains.
template <typename T, int E>
inline void product_nt(const T* X, const T* YT, T* out, int64_t tr, int64_t tp, int64_t e) {
    typedef typename Vec<T>::V V;
    constexpr int64_t vl = VL<T>;
    const int64_t w = E ? E : e;
    for (int64_t i0 = 0; i0 < tr; i0 += ROWS) {
        const T* x = X + i0 * w;
        int64_t jb = 0;
        for (; jb + 2 * vl <= tp; jb += 2 * vl) {
            V a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {}, y0, y1;
            for (int64_t d = 0; d < w; ++d) {
                __builtin_memcpy(&y0, YT + d * tp + jb, sizeof(V));
                __builtin_memcpy(&y1, YT + d * tp + jb + vl, sizeof(V));
                a0 += x[d] * y0;
                b0 += x[d] * y1;
                a1 += x[w + d] * y0;
                b1 += x[w + d] * y1;
                a2 += x[2 * w + d] * y0;
                b2 += x[2 * w + d] * y1;
                a3 += x[3 * w + d] * y0;
                b3 += x[3 * w + d] * y1;
            }
            T* o = out + i0 * tp + jb;
            __builtin_memcpy(o, &a0, sizeof(V));
            __builtin_memcpy(o + vl, &b0, sizeof(V));
            __builtin_memcpy(o + tp, &a1, sizeof(V));
            __builtin_memcpy(o + tp + vl, &b1, sizeof(V));
            __builtin_memcpy(o + 2 * tp, &a2, sizeof(V));
            __builtin_memcpy(o + 2 * tp + vl, &b2, sizeof(V));
            __builtin_memcpy(o + 3 * tp, &a3, sizeof(V));
            __builtin_memcpy(o + 3 * tp + vl, &b3, sizeof(V));
        }
        for (; jb < tp; jb += vl) {
            V a0 = {}, a1 = {}, a2 = {}, a3 = {}, y0;
            for (int64_t d = 0; d < w; ++d) {
                __builtin_memcpy(&y0, YT + d * tp + jb, sizeof(V));
                a0 += x[d] * y0;
                a1 += x[w + d] * y0;
                a2 += x[2 * w + d] * y0;
                a3 += x[3 * w + d] * y0;
            }
            T* o = out + i0 * tp + jb;
            __builtin_memcpy(o, &a0, sizeof(V));
            __builtin_memcpy(o + tp, &a1, sizeof(V));
            __builtin_memcpy(o + 2 * tp, &a2, sizeof(V));
            __builtin_memcpy(o + 3 * tp, &a3, sizeof(V));
        }
    }
}

// The two products that sum over keys or queries with a [tr, e] right-hand side:
//   nn: out[i, :] (+)= sum_{j < n} P[i, j] Y[j, :]   (P Y)
//   tn: out[j, :] (+)= sum_{i < n} P[i, j] Y[i, :]   (P^T Y)
// 4 output rows at a time, the sum split over even and odd terms (8 chains). With
// a runtime width the plain loops.
template <typename T, int E, bool ADD, bool TRANSPOSED>
inline void product_sum(const T* P, const T* Y, T* out, int64_t tr, int64_t n, int64_t tp, int64_t e) {
    if constexpr (E > 0 && (E * sizeof(T)) % PETFUNC_VBYTES == 0) {
        typedef typename Vec<T>::V V;
        constexpr int64_t vl = VL<T>;
        for (int64_t i0 = 0; i0 < tr; i0 += ROWS) {
            for (int64_t db = 0; db < E; db += vl) {
                V a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {}, y0, y1;
                // weight of output row i0 + r, summed index j
                auto weight = [&](int64_t r, int64_t j) { return TRANSPOSED ? P[j * tp + i0 + r] : P[(i0 + r) * tp + j]; };
                int64_t j = 0;
                for (; j + 2 <= n; j += 2) {
                    __builtin_memcpy(&y0, Y + j * E + db, sizeof(V));
                    __builtin_memcpy(&y1, Y + (j + 1) * E + db, sizeof(V));
                    a0 += weight(0, j) * y0;
                    b0 += weight(0, j + 1) * y1;
                    a1 += weight(1, j) * y0;
                    b1 += weight(1, j + 1) * y1;
                    a2 += weight(2, j) * y0;
                    b2 += weight(2, j + 1) * y1;
                    a3 += weight(3, j) * y0;
                    b3 += weight(3, j + 1) * y1;
                }
                if (j < n) {
                    __builtin_memcpy(&y0, Y + j * E + db, sizeof(V));
                    a0 += weight(0, j) * y0;
                    a1 += weight(1, j) * y0;
                    a2 += weight(2, j) * y0;
                    a3 += weight(3, j) * y0;
                }
                V r[4] = {a0 + b0, a1 + b1, a2 + b2, a3 + b3};
                for (int64_t k = 0; k < ROWS; ++k) {
                    T* o = out + (i0 + k) * E + db;
                    if (ADD) {
                        V old;
                        __builtin_memcpy(&old, o, sizeof(V));
                        r[k] += old;
                    }
                    __builtin_memcpy(o, &r[k], sizeof(V));
                }
            }
        }
    } else {
        const int64_t w = E ? E : e;
        for (int64_t i = 0; i < tr; ++i) {
            T* o = out + i * w;
            if (!ADD)
                for (int64_t d = 0; d < w; ++d) o[d] = T(0);
            for (int64_t j = 0; j < n; ++j) {
                const T p = TRANSPOSED ? P[j * tp + i] : P[i * tp + j];
                for (int64_t d = 0; d < w; ++d) o[d] += p * Y[j * w + d];
            }
        }
    }
}

template <typename T, int E, bool ADD>
inline void product_nn(const T* P, const T* Y, T* out, int64_t tr, int64_t t, int64_t tp, int64_t e) {
    product_sum<T, E, ADD, false>(P, Y, out, tr, t, tp, e);
}

template <typename T, int E, bool ADD>
inline void product_tn(const T* P, const T* X, T* out, int64_t tr, int64_t tp, int64_t e) {
    product_sum<T, E, ADD, true>(P, X, out, tr, tr, tp, e);
}

// One thread's buffers for one head of one atom.
template <typename T, int E>
struct Block {
    int64_t t, tr, tp, e, H;
    std::vector<T> q, k, v, kt, vt, bias;  // [tr, e] (q scaled by c), [e, tp], [tp]
    std::vector<T> p, x1, x2, x3, x4;      // [tr, tp]
    std::vector<T> a1, a2, a3, a4, a5;     // [tr, e]
    std::vector<T> y1, y2;                 // [e, tp]

    Block(int64_t t_, int64_t H_, int64_t e_)
        : t(t_), tr(round_up(t_, ROWS)), tp(round_up(t_, VL<T>)), e(E ? E : e_), H(H_) {
        for (auto* m : {&q, &k, &v, &a1, &a2, &a3, &a4, &a5}) m->assign(tr * e, T(0));
        for (auto* m : {&kt, &vt, &y1, &y2}) m->assign(e * tp, T(0));
        for (auto* m : {&p, &x1, &x2, &x3, &x4}) m->assign(tr * tp, T(0));
        bias.assign(tp, T(0));
    }

    // rows [t, e] of head h from a [t, 3, H, e] (part 0, 1, 2) or [t, H, e] (part -1)
    // array into m [tr, e] (times scale) and, if mt, its transpose into mt [e, tp]
    void gather(const T* src, int part, int64_t h, T* m, T* mt, T scale = T(1)) const {
        const int64_t w = E ? E : e;
        const int64_t stride = part < 0 ? H * w : 3 * H * w;
        const int64_t offset = (part < 0 ? 0 : part * H * w) + h * w;
        for (int64_t i = 0; i < t; ++i) {
            const T* row = src + i * stride + offset;
#pragma omp simd
            for (int64_t d = 0; d < w; ++d) m[i * w + d] = scale * row[d];
        }
        if (mt)
            for (int64_t i = 0; i < t; ++i) {
                const T* row = src + i * stride + offset;
                for (int64_t d = 0; d < w; ++d) mt[d * tp + i] = row[d];
            }
    }

    void scatter(const T* m, T* dst, int part, int64_t h, T scale = T(1)) const {
        const int64_t w = E ? E : e;
        const int64_t stride = part < 0 ? H * w : 3 * H * w;
        const int64_t offset = (part < 0 ? 0 : part * H * w) + h * w;
        for (int64_t i = 0; i < t; ++i) {
            T* row = dst + i * stride + offset;
#pragma omp simd
            for (int64_t d = 0; d < w; ++d) row[d] = scale * m[i * w + d];
        }
    }

    void load_bias(const T* b) {
        for (int64_t j = 0; j < t; ++j) bias[j] = b[j];
        for (int64_t j = t; j < tp; ++j) bias[j] = T(-1e30);
    }

    // p = softmax(q k^T + bias) row-wise for the t real rows (q holds c * q)
    void softmax() {
        product_nt<T, E>(q.data(), kt.data(), p.data(), tr, tp, e);
        typedef typename Vec<T>::V V;
        constexpr int64_t vl = VL<T>;
        for (int64_t i = 0; i < t; ++i) {
            T* row = p.data() + i * tp;
            V vmax, bv, x;
            for (int64_t jb = 0; jb < tp; jb += vl) {
                __builtin_memcpy(&x, row + jb, sizeof(V));
                __builtin_memcpy(&bv, bias.data() + jb, sizeof(V));
                x += bv;
                __builtin_memcpy(row + jb, &x, sizeof(V));
                vmax = jb == 0 ? x : (x > vmax ? x : vmax);
            }
            const T m = reduce_max<T>(vmax);
            for (int64_t jb = 0; jb < tp; jb += vl) {
                __builtin_memcpy(&x, row + jb, sizeof(V));
                x -= m;
                __builtin_memcpy(row + jb, &x, sizeof(V));
            }
            const T inv = T(1) / exp_row(row, tp);
            for (int64_t jb = 0; jb < tp; jb += vl) {
                __builtin_memcpy(&x, row + jb, sizeof(V));
                x *= inv;
                __builtin_memcpy(row + jb, &x, sizeof(V));
            }
        }
        // padded rows stay zero (product_nt wrote q's zero rows: zeros)
    }
};

template <typename T, int E>
void forward(const T* qkv, const T* bias, T* out, int64_t A, int64_t t, int64_t H, int64_t e_, T c, int threads) {
#pragma omp parallel num_threads(threads)
    {
        Block<T, E> b(t, H, e_);
        const int64_t e = b.e;
#pragma omp for schedule(static)
        for (int64_t a = 0; a < A; ++a) {
            const T* qa = qkv + a * t * 3 * H * e;
            b.load_bias(bias + a * t);
            for (int64_t h = 0; h < H; ++h) {
                b.gather(qa, 0, h, b.q.data(), nullptr, c);
                b.gather(qa, 1, h, b.k.data(), b.kt.data());
                b.gather(qa, 2, h, b.v.data(), nullptr);
                b.softmax();
                product_nn<T, E, false>(b.p.data(), b.v.data(), b.a1.data(), b.tr, t, b.tp, e);
                b.scatter(b.a1.data(), out + a * t * H * e, -1, h);
            }
        }
    }
}

// dP = G V^T, r = rowsum(P dP), dS = P (dP - r) into ds; dp keeps dP
template <typename T, int E>
inline void softmax_backward(Block<T, E>& b, const T* g, T* dp, T* ds, T* r) {
    product_nt<T, E>(g, b.vt.data(), dp, b.tr, b.tp, b.e);
    for (int64_t i = 0; i < b.t; ++i) {
        const T* pi = b.p.data() + i * b.tp;
        T* dpi = dp + i * b.tp;
        T* dsi = ds + i * b.tp;
        const T ri = dot_row(pi, dpi, b.tp);
#pragma omp simd
        for (int64_t j = 0; j < b.tp; ++j) dsi[j] = pi[j] * (dpi[j] - ri);
        r[i] = ri;
    }
}

template <typename T, int E>
inline void add_column_sums(const Block<T, E>& b, const T* m, T* acc) {
    for (int64_t i = 0; i < b.t; ++i)
#pragma omp simd
        for (int64_t j = 0; j < b.t; ++j) acc[j] += m[i * b.tp + j];
}

template <typename T, int E>
void backward(const T* qkv, const T* bias, const T* g, T* gqkv, T* gbias, int64_t A, int64_t t, int64_t H,
              int64_t e_, T c, int threads) {
#pragma omp parallel num_threads(threads)
    {
        Block<T, E> b(t, H, e_);
        const int64_t e = b.e;
        std::vector<T> r(b.tr);
#pragma omp for schedule(static)
        for (int64_t a = 0; a < A; ++a) {
            const T* qa = qkv + a * t * 3 * H * e;
            T* gqa = gqkv + a * t * 3 * H * e;
            b.load_bias(bias + a * t);
            T* gba = gbias + a * t;
            for (int64_t j = 0; j < t; ++j) gba[j] = T(0);
            for (int64_t h = 0; h < H; ++h) {
                b.gather(qa, 0, h, b.q.data(), nullptr, c);
                b.gather(qa, 1, h, b.k.data(), b.kt.data());
                b.gather(qa, 2, h, b.v.data(), b.vt.data());
                b.gather(g + a * t * H * e, -1, h, b.a1.data(), nullptr);  // G
                b.softmax();
                softmax_backward(b, b.a1.data(), b.x1.data(), b.x2.data(), r.data());
                product_nn<T, E, false>(b.x2.data(), b.k.data(), b.a2.data(), b.tr, t, b.tp, e);  // dS K
                b.scatter(b.a2.data(), gqa, 0, h, c);
                product_tn<T, E, false>(b.x2.data(), b.q.data(), b.a3.data(), b.tr, b.tp, e);  // c dS^T Q
                b.scatter(b.a3.data(), gqa, 1, h);
                product_tn<T, E, false>(b.p.data(), b.a1.data(), b.a4.data(), b.tr, b.tp, e);  // P^T G
                b.scatter(b.a4.data(), gqa, 2, h);
                add_column_sums(b, b.x2.data(), gba);
            }
        }
    }
}

template <typename T, int E>
void backward2(const T* qkv, const T* bias, const T* g, const T* ggqkv, const T* ggbias, T* out_qkv, T* out_bias,
               T* out_g, int64_t A, int64_t t, int64_t H, int64_t e_, T c, int threads) {
#pragma omp parallel num_threads(threads)
    {
        Block<T, E> b(t, H, e_);
        const int64_t e = b.e, tp = b.tp, tr = b.tr;
        std::vector<T> r(tr), beta(tp), ga(tr * e);
        T *G = b.a1.data(), *Ac = b.a2.data(), *Bb = b.a3.data(), *Cb = b.a4.data(), *acc = b.a5.data();
        T *DP = b.x1.data(), *DS = b.x2.data(), *W = b.x3.data(), *X = b.x4.data();
#pragma omp for schedule(static)
        for (int64_t a = 0; a < A; ++a) {
            const T* qa = qkv + a * t * 3 * H * e;
            const T* gga = ggqkv + a * t * 3 * H * e;
            T* oqa = out_qkv + a * t * 3 * H * e;
            b.load_bias(bias + a * t);
            for (int64_t j = 0; j < t; ++j) beta[j] = ggbias[a * t + j];
            for (int64_t j = t; j < tp; ++j) beta[j] = T(0);
            T* gba = out_bias + a * t;
            for (int64_t j = 0; j < t; ++j) gba[j] = T(0);
            for (int64_t h = 0; h < H; ++h) {
                b.gather(qa, 0, h, b.q.data(), nullptr, c);
                b.gather(qa, 1, h, b.k.data(), b.kt.data());
                b.gather(qa, 2, h, b.v.data(), b.vt.data());
                b.gather(g + a * t * H * e, -1, h, G, nullptr);
                b.gather(gga, 0, h, Ac, nullptr, c);          // c A_
                b.gather(gga, 1, h, Bb, b.y1.data());         // B_ and B_^T
                b.gather(gga, 2, h, Cb, b.y2.data());         // C_ and C_^T
                b.softmax();
                softmax_backward(b, G, DP, DS, r.data());
                // W = c A_ K^T + (c Q) B_^T + beta;  X = G C_^T
                product_nt<T, E>(Ac, b.kt.data(), W, tr, tp, e);
                product_nt<T, E>(b.q.data(), b.y1.data(), X, tr, tp, e);
                for (int64_t i = 0; i < t; ++i) {
                    T* wi = W + i * tp;
                    const T* xi = X + i * tp;
#pragma omp simd
                    for (int64_t j = 0; j < tp; ++j) wi[j] += xi[j] + beta[j];
                }
                product_nt<T, E>(G, b.y2.data(), X, tr, tp, e);
                for (int64_t i = 0; i < t; ++i) {
                    const T* pi = b.p.data() + i * tp;
                    const T* dpi = DP + i * tp;
                    T* wi = W + i * tp;
                    T* xi = X + i * tp;
                    const T ri = r[i];
                    const T u = dot_row(wi, pi, tp);
#pragma omp simd
                    for (int64_t j = 0; j < tp; ++j) xi[j] = wi[j] * (dpi[j] - ri) - u * dpi[j] + xi[j];  // Pbar
                    const T s = dot_row(pi, xi, tp);
#pragma omp simd
                    for (int64_t j = 0; j < tp; ++j) {
                        wi[j] = pi[j] * (wi[j] - u);  // dPbar
                        xi[j] = pi[j] * (xi[j] - s);  // Sbar
                    }
                }
                for (int64_t i = t; i < tr; ++i)
                    for (int64_t j = 0; j < tp; ++j) W[i * tp + j] = X[i * tp + j] = T(0);
                add_column_sums(b, X, gba);
                // gQ = c (Sbar K + dS B_)
                product_nn<T, E, false>(X, b.k.data(), acc, tr, t, tp, e);
                product_nn<T, E, true>(DS, Bb, acc, tr, t, tp, e);
                b.scatter(acc, oqa, 0, h, c);
                // gK = Sbar^T (c Q) + dS^T (c A_)
                product_tn<T, E, false>(X, b.q.data(), acc, tr, tp, e);
                product_tn<T, E, true>(DS, Ac, acc, tr, tp, e);
                b.scatter(acc, oqa, 1, h);
                // gV = dPbar^T G
                product_tn<T, E, false>(W, G, acc, tr, tp, e);
                b.scatter(acc, oqa, 2, h);
                // gG = dPbar V + P C_
                product_nn<T, E, false>(W, b.v.data(), ga.data(), tr, t, tp, e);
                product_nn<T, E, true>(b.p.data(), Cb, ga.data(), tr, t, tp, e);
                b.scatter(ga.data(), out_g + a * t * H * e, -1, h);
            }
        }
    }
}

// f.template operator()<E>() with E the head width when it is one of the usual
// ones (loops over the width unrolled), else 0 (runtime width)
template <typename F>
inline void dispatch(int64_t e, F f) {
    switch (e) {
        case 8: f(std::integral_constant<int, 8>()); break;
        case 16: f(std::integral_constant<int, 16>()); break;
        case 32: f(std::integral_constant<int, 32>()); break;
        case 64: f(std::integral_constant<int, 64>()); break;
        default: f(std::integral_constant<int, 0>()); break;
    }
}

}  // namespace

extern "C" {

#define PETFUNC_ENTRIES(suffix, T)                                                                                   \
    void petfunc_attention_forward_##suffix(const T* qkv, const T* bias, T* out, int64_t A, int64_t t, int64_t H,   \
                                            int64_t e, double c, int threads) {                                     \
        dispatch(e, [&](auto E) { forward<T, decltype(E)::value>(qkv, bias, out, A, t, H, e, T(c), threads); });    \
    }                                                                                                                \
    void petfunc_attention_backward_##suffix(const T* qkv, const T* bias, const T* g, T* gqkv, T* gbias, int64_t A, \
                                             int64_t t, int64_t H, int64_t e, double c, int threads) {              \
        dispatch(e, [&](auto E) {                                                                                    \
            backward<T, decltype(E)::value>(qkv, bias, g, gqkv, gbias, A, t, H, e, T(c), threads);                  \
        });                                                                                                          \
    }                                                                                                                \
    void petfunc_attention_backward2_##suffix(const T* qkv, const T* bias, const T* g, const T* ggqkv,              \
                                              const T* ggbias, T* out_qkv, T* out_bias, T* out_g, int64_t A,        \
                                              int64_t t, int64_t H, int64_t e, double c, int threads) {             \
        dispatch(e, [&](auto E) {                                                                                    \
            backward2<T, decltype(E)::value>(qkv, bias, g, ggqkv, ggbias, out_qkv, out_bias, out_g, A, t, H, e,     \
                                             T(c), threads);                                                         \
        });                                                                                                          \
    }

PETFUNC_ENTRIES(f32, float)
PETFUNC_ENTRIES(f64, double)

}  // extern "C"
