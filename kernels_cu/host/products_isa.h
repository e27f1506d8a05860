// products_isa.h: the few-row product's code for one instruction set (products.cpp includes it once per ISA,
// each time in a namespace of its own under that ISA's target pragma). The includer defines, in that namespace:
//   kW      floats per vector; V, a GCC vector of kW floats;
//   kAcc    accumulators (vectors) a group keeps: half the ISA's vector registers;
//   madd    madd(a, b, c) = a * b + c lane by lane: one fused multiply-add where the ISA has one (an intrinsic, so
//           every shape rounds alike: the compiler's own contraction differs between instantiations), else a
//           multiply and an add;
//   in_register  in_register(v): v is kept in a register here (an empty asm), so a row of x is loaded once per k
//           step, not once per product using it (which the compiler prefers: 20 - 25% slower at 8 rows);
// and Product, kMaxBlock, kPrefetchRows (products.cpp). Defines run(p, n0, n1): columns [n0, n1) of p.
// No include guard: included once per ISA namespace.

__attribute__((always_inline)) inline V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

__attribute__((always_inline)) inline float lanes_sum(V v) {
    float s[kW];
    std::memcpy(s, &v, sizeof s);
#pragma GCC unroll 16
    for (int h = kW / 2; h >= 1; h /= 2)
#pragma GCC unroll 16
        for (int i = 0; i < h; ++i) s[i] += s[i + h];
    return s[0];
}

// out[0 .. MB, 0 .. J] (ldo apart) = x[0 .. MB] . w[0 .. J], K long.
template <int MB, int J, bool kPrefetch>
__attribute__((always_inline)) inline void group(const float* x, int64_t ldx, const float* w, int64_t ldw, float* out,
                                                 int64_t ldo, int K, bool accumulate) {
    V acc[MB][J];
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < J; ++j) acc[i][j] = V{};
    int k = 0;
    for (; k + kW <= K; k += kW) {
        V wv[J];
#pragma GCC unroll 16
        for (int j = 0; j < J; ++j) wv[j] = load(w + j * ldw + k);
        if constexpr (kPrefetch) {
#pragma GCC unroll 16
            for (int j = 0; j < J; ++j) __builtin_prefetch(w + (j + kPrefetchRows) * ldw + k, 0, 3);
        }
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
            V xv = load(x + i * ldx + k);
            in_register(xv);  // loaded once for its J products (else each folds a load of its own)
#pragma GCC unroll 16
            for (int j = 0; j < J; ++j) acc[i][j] = madd(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < J; ++j) {
            float s = lanes_sum(acc[i][j]);
            for (int t = k; t < K; ++t) s = __builtin_fmaf(x[i * ldx + t], w[j * ldw + t], s);
            float* o = out + i * ldo + j;
            *o = accumulate ? *o + s : s;
        }
}

// Columns [n0, n1) for every row of x: J rows of w at a time, the rows of x in blocks of MB (the last block of
// M % MB rows, when M > MB), then the n1 - n0 % J rows of w left one by one.
template <int MB, int J>
__attribute__((always_inline)) inline void columns(const Product& p, int n0, int n1) {
    constexpr bool kPrefetch = MB >= 4;
    const int full = p.m / MB * MB, rest = p.m - full;
    const auto rows = [&](const float* w, float* out, auto j_tag) {
        constexpr int kJ = decltype(j_tag)::value;
        for (int i = 0; i < full; i += MB)
            group<MB, kJ, kPrefetch>(p.x + i * p.ldx, p.ldx, w, p.ldw, out + i * p.ldo, p.ldo, p.k, p.accumulate);
        if (rest) {
            const float* x = p.x + full * p.ldx;
            float* o = out + full * p.ldo;
            switch (rest) {  // MB <= 8
#define CUPAGED_REST(R)                                                                                              \
    case R:                                                                                                          \
        if constexpr (R < MB) group<R, kJ, kPrefetch>(x, p.ldx, w, p.ldw, o, p.ldo, p.k, p.accumulate);         \
        break;
                CUPAGED_REST(1)
                CUPAGED_REST(2)
                CUPAGED_REST(3)
                CUPAGED_REST(4)
                CUPAGED_REST(5)
                CUPAGED_REST(6)
                CUPAGED_REST(7)
#undef CUPAGED_REST
            }
        }
    };
    int n = n0;
    for (; n + J <= n1; n += J) rows(p.w + n * p.ldw, p.out + n, std::integral_constant<int, J>{});
    for (; n < n1; ++n) rows(p.w + n * p.ldw, p.out + n, std::integral_constant<int, 1>{});
}

// The MB x J shape for M rows: J rows of w beside MB rows of x, MB x J accumulators within the register file
// (kAcc), MB = min(M, kMaxBlock).
void run(const Product& p, int n0, int n1) {
    switch (p.m < kMaxBlock ? p.m : kMaxBlock) {
#define CUPAGED_SHAPE(MB)                                                                                            \
    case MB:                                                                                                         \
        columns<MB, (kAcc / MB < 8 ? (kAcc / MB > 0 ? kAcc / MB : 1) : 8)>(p, n0, n1);                            \
        break;
        CUPAGED_SHAPE(1)
        CUPAGED_SHAPE(2)
        CUPAGED_SHAPE(3)
        CUPAGED_SHAPE(4)
        CUPAGED_SHAPE(5)
        CUPAGED_SHAPE(6)
        CUPAGED_SHAPE(7)
        CUPAGED_SHAPE(8)
#undef CUPAGED_SHAPE
    }
}
