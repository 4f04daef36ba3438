// Torch-free checks of the CPU kernels' cores (kernels/cpu/*.h), for instruction sets this
// machine cannot run natively: tests/test_aarch64_cross.py builds this file for aarch64 and runs
// it under qemu-aarch64, and builds it natively as a check of the driver itself.
//
//   driver EXPECTED   compares every case with EXPECTED (expected.txt); exit status 1 on any
//                     mismatch, each one printed
//   driver --dump     prints every case's output (gen_expected.py records the AVX2 build's)
//
// Inputs come from a 32-bit LCG (gen_expected.py draws the same numbers), as small multiples of
// 1/256 so that Python and C++ hold the same floats. EXPECTED holds, per case:
//   twin NAME n hex...   the PyTorch twin's output (kernels/formats.py, kernels/cpu/linear.py):
//                        equal for the roundings, within the case's tolerance for float sums;
//   bits FAMILY NAME n hex...   the output bit for bit of the builds of FAMILY: "avx2" holds the
//                        x86 AVX2 (and AVX-VNNI) paths' bits, which the aarch64 NEON paths
//                        reproduce (int_dot.h, linear.h).
#include "../attention_int.h"
#include "../flash_prefill.h"
#include "../int4_dot.h"
#include "../int_dot.h"
#include "../isa.h"
#include "../linear.h"
#include "../norm_rope.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

// The builds whose float sums share one order, named in EXPECTED's `bits` records.
#if defined(QSPEC_AVX512_VNNI)
const char* kFamily = "avx512";
#elif defined(QSPEC_AVX2) || defined(QSPEC_NEON)
const char* kFamily = "avx2";
#else
const char* kFamily = "portable";
#endif

const char* kPaths =
#if defined(QSPEC_AVX512_VNNI)
    "AVX-512 VNNI";
#elif defined(QSPEC_AVX_VNNI)
    "AVX2 + AVX-VNNI";
#elif defined(QSPEC_AVX2)
    "AVX2";
#elif defined(QSPEC_NEON_DOTPROD)
    "NEON + dotprod";
#elif defined(QSPEC_NEON)
    "NEON";
#else
    "portable C++";
#endif

struct SerialFor {  // the cores' parallel_for, in one piece
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t, const F& fn) const {
    fn(begin, end);
  }
};

struct Lcg {  // x <- 1664525 x + 1013904223 (mod 2^32); gen_expected.py's `Lcg`
  uint32_t state;
  uint32_t next() { return state = 1664525u * state + 1013904223u; }
  int32_t below(int32_t n) { return int32_t((next() >> 8) % uint32_t(n)); }  // 0 .. n - 1
  // lo .. hi in steps of 1/256 (exact in fp32 and in Python's floats)
  float fixed(int32_t lo, int32_t hi) { return float(lo + below(hi - lo + 1)) / 256.f; }
};

std::vector<float> floats(Lcg& g, int64_t n, int32_t lo, int32_t hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = g.fixed(lo, hi);
  return v;
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Case {
  std::string name;
  std::vector<float> out;
  // against the twin: |out - twin| <= atol * max|twin| + rtol * |twin| (max over the case's
  // outputs: sums whose terms cancel keep the error of their largest terms); 0, 0: equal
  double rtol, atol;
};

// ------------------------------------------------------------------------------------ cases

// round_to_codes on one chunk: codes then the step, as floats. A chunk of 64 (int8) or of a
// head (int16); `kind` 0: random, 1: tiny (below kMinAmax: zeros), 2: a NaN inside.
template <typename Code>
Case rounding_case(const char* name, uint32_t seed, int64_t n, int kind) {
  Lcg g{seed};
  std::vector<float> x = floats(g, n, -2000, 2000);
  if (kind == 1)
    for (auto& v : x) v *= 1e-33f;
  if (kind == 2) x[n / 3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<Code> codes(n);
  const float step = round_to_codes(x.data(), n, codes.data());
  Case c{name, {}, 0, 0};
  for (auto q : codes) c.out.push_back(float(q));
  c.out.push_back(step);
  return c;
}

// `gemm`: the many-row schedule (w8a8_gemm), which must give w8a8_rows's bits.
Case w8a8_case(const char* name, uint32_t seed, int64_t M, int64_t K, int64_t N, bool bias,
               bool gemm = false) {
  Lcg g{seed};
  std::vector<float> x = floats(g, M * K, -1024, 1024);
  std::vector<int8_t> w(N * K);
  for (auto& v : w) v = int8_t(g.below(256) - 128);
  std::vector<float> scale = floats(g, N, 1, 64), b = floats(g, N, -256, 256);
  Case c{name, std::vector<float>(M * N), 2e-5, 1e-5};
  const auto run = gemm ? intdot::w8a8_gemm<SerialFor> : intdot::w8a8_rows<SerialFor>;
  run(x.data(), M, K, w.data(), scale.data(), bias ? b.data() : nullptr, N, c.out.data(),
      SerialFor{});
  return c;
}

Case int4_case(const char* name, uint32_t seed, int64_t M, int64_t K, int64_t N, int64_t G,
               bool bias) {
  Lcg g{seed};
  std::vector<float> x = floats(g, M * K, -1024, 1024);
  std::vector<uint8_t> packed(N * K / 2);
  for (auto& v : packed) v = uint8_t(g.below(256));
  std::vector<float> scale = floats(g, N * (K / G), 1, 64);
  std::vector<float> zero = floats(g, N * (K / G), 0, 15 * 256);
  std::vector<float> b = floats(g, N, -256, 256);
  Case c{name, std::vector<float>(M * N), 2e-5, 1e-4};
  intdot::int4_rows(x.data(), M, K, packed.data(), scale.data(), zero.data(), G,
                    bias ? b.data() : nullptr, N, c.out.data(), SerialFor{});
  return c;
}

Case linear_f32_case(const char* name, uint32_t seed, int64_t M, int64_t K, int64_t N,
                     bool bias) {
  Lcg g{seed};
  std::vector<float> x = floats(g, M * K, -512, 512), w = floats(g, N * K, -256, 256);
  std::vector<float> b = floats(g, N, -256, 256);
  Case c{name, std::vector<float>(M * N), 2e-5, 1e-5};
  rowlinear::rows(x.data(), w.data(), nullptr, bias ? b.data() : nullptr, c.out.data(), M, K, N,
                  SerialFor{});
  return c;
}

Case linear_i8_case(const char* name, uint32_t seed, int64_t M, int64_t K, int64_t N) {
  Lcg g{seed};
  std::vector<float> x = floats(g, M * K, -512, 512);
  std::vector<int8_t> w(N * K);
  for (auto& v : w) v = int8_t(g.below(256) - 128);
  std::vector<float> scale = floats(g, N, 1, 64);
  Case c{name, std::vector<float>(M * N), 2e-5, 1e-5};
  rowlinear::rows(x.data(), w.data(), scale.data(), nullptr, c.out.data(), M, K, N, SerialFor{});
  return c;
}

Case rms_norm_case(const char* name, uint32_t seed, int64_t M, int64_t H) {
  Lcg g{seed};
  std::vector<float> x = floats(g, M * H, -1024, 1024), w = floats(g, H, -512, 512);
  Case c{name, std::vector<float>(M * H), 1e-5, 1e-6};
  for (int64_t m = 0; m < M; ++m)
    norm_row(x.data() + m * H, w.data(), c.out.data() + m * H, H, 1e-5f);
  return c;
}

Case rope_case(const char* name, uint32_t seed, int64_t T, int64_t D) {
  Lcg g{seed};
  std::vector<float> x = floats(g, T * D, -1024, 1024);
  std::vector<float> cs = floats(g, T * D, -256, 256), sn = floats(g, T * D, -256, 256);
  for (int64_t t = 0; t < T; ++t)
    rope_row(x.data() + t * D, cs.data() + t * D, sn.data() + t * D, D);
  return Case{name, x, 1e-6, 1e-6};
}

// The attention's integer query dots (attention_int.h): int16 codes against a block of tokens'
// nibble planes, draft (U) and target (16 U + lower); exact integers.
template <bool TARGET>
Case attention_dots_case(const char* name, uint32_t seed, int64_t RT, int64_t n, int64_t D) {
  Lcg g{seed};
  std::vector<uint8_t> up(n * D / 2), lo(n * D / 2);
  for (auto& v : up) v = uint8_t(g.below(256));
  for (auto& v : lo) v = uint8_t(g.below(256));
  std::vector<int16_t> codes(RT * D);
  for (auto& v : codes) v = int16_t(g.below(65535) - 32767);
  std::vector<int32_t> dots(RT * n);
  attn::int_dots<0, TARGET>(up.data(), lo.data(), n, D, codes.data(), RT, dots.data());
  Case c{name, {}, 0, 0};
  for (auto d : dots) c.out.push_back(float(d));  // (|d| < 2^31; as float: the twin rounds too)
  return c;
}

// The tiled causal prefill attention: q [H, T, D] at positions start.. over k/v rows with a
// head stride beyond the used length (the cache's layout).
Case flash_case(const char* name, uint32_t seed, int64_t H, int64_t n_kv, int64_t T,
                int64_t start, int64_t D) {
  Lcg g{seed};
  const int64_t S = start + T, stride = (S + 3) * D;
  std::vector<float> q = floats(g, H * T * D, -512, 512);
  std::vector<float> k = floats(g, n_kv * stride, -512, 512);
  std::vector<float> v = floats(g, n_kv * stride, -512, 512);
  Case c{name, std::vector<float>(H * T * D), 2e-5, 1e-5};
  flash::causal(q.data(), H, T, D, k.data(), v.data(), n_kv, stride, start, flash::ScoreRule{},
                c.out.data(), flash::Operands::kFp32, /*min_units=*/1, SerialFor{});
  return c;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  cases.push_back(rounding_case<int8_t>("round_int8", 1, 64, 0));
  cases.push_back(rounding_case<int8_t>("round_int8_tiny", 2, 64, 1));
  cases.push_back(rounding_case<int8_t>("round_int8_nan", 3, 64, 2));
  cases.push_back(rounding_case<int16_t>("round_int16", 4, 128, 0));
  cases.push_back(rounding_case<int16_t>("round_int16_d80", 5, 80, 0));
  // up to the largest step (the extension's flag: the tests build with its compile_flags())
  const int64_t rows[] = {1, 2, 3, 5, 8, 9, QSPEC_MAX_STEP_ROWS};
  for (int64_t M : rows) {
    const std::string m = std::to_string(M);
    cases.push_back(w8a8_case(("w8a8_m" + m).c_str(), 100 + M, M, 192, 13, M % 2 == 1));
    if (M <= 8)
      cases.push_back(int4_case(("int4_m" + m).c_str(), 200 + M, M, 256, 11, 128, M % 2 == 0));
    cases.push_back(linear_f32_case(("linear_f32_m" + m).c_str(), 300 + M, M, 100, 9, M % 2));
    cases.push_back(linear_i8_case(("linear_i8_m" + m).c_str(), 400 + M, M, 136, 7));
  }
  // a prefill's rows (not a multiple of the row block) over N with a partial slab
  cases.push_back(w8a8_case("w8a8_gemm_m42", 142, 42, 192, 21, true, true));
  cases.push_back(int4_case("int4_g64", 250, 3, 192, 6, 64, true));
  cases.push_back(flash_case("flash_d64", 800, 6, 2, 45, 70, 64));
  cases.push_back(flash_case("flash_d80", 801, 2, 1, 33, 0, 80));
  cases.push_back(rms_norm_case("rms_norm", 500, 3, 576));
  cases.push_back(rope_case("rope", 600, 4, 64));
  cases.push_back(attention_dots_case<false>("attn_dots_draft", 700, 3, 7, 64));
  cases.push_back(attention_dots_case<true>("attn_dots_target", 701, 2, 5, 128));
  cases.push_back(attention_dots_case<true>("attn_dots_target_d80", 702, 2, 3, 80));
  return cases;
}

// ------------------------------------------------------------------------------------ checks

std::vector<float> read_floats(std::istringstream& line, int64_t n) {
  std::vector<float> v(n);
  for (auto& x : v) {
    std::string hex;
    line >> hex;
    x = float_of(uint32_t(std::strtoul(hex.c_str(), nullptr, 16)));
  }
  return v;
}

bool same(float a, float b) { return bits_of(a) == bits_of(b) || (a != a && b != b); }

int check(const std::vector<Case>& cases, const char* path) {
  std::map<std::string, const Case*> by_name;
  for (const auto& c : cases) by_name[c.name] = &c;
  std::ifstream file(path);
  if (!file) {
    std::printf("cannot read %s\n", path);
    return 2;
  }
  int failures = 0, twins = 0, exact = 0;
  std::string text;
  while (std::getline(file, text)) {
    if (text.empty() || text[0] == '#') continue;
    std::istringstream line(text);
    std::string kind, family, name;
    line >> kind;
    if (kind == "bits") line >> family;
    line >> name;
    int64_t n;
    line >> n;
    const auto found = by_name.find(name);
    if (found == by_name.end()) {
      std::printf("FAIL %s: no such case in the driver\n", name.c_str());
      ++failures;
      continue;
    }
    const Case& c = *found->second;
    const std::vector<float> want = read_floats(line, n);
    if (kind == "bits" && family != kFamily) continue;
    if (int64_t(c.out.size()) != n) {
      std::printf("FAIL %s: %zu outputs, expected %" PRId64 "\n", name.c_str(), c.out.size(), n);
      ++failures;
      continue;
    }
    const bool exactly = kind == "bits" || (c.rtol == 0 && c.atol == 0);
    double largest = 0;  // the case's largest |output|: atol is relative to it
    for (float x : want) largest = x == x ? std::max(largest, double(std::abs(x))) : largest;
    int bad = 0;
    double worst = 0;  // the largest error as a fraction of its tolerance
    for (int64_t i = 0; i < n; ++i) {
      const double err = std::abs(double(c.out[i]) - double(want[i]));
      const double tol = c.atol * largest + c.rtol * std::abs(want[i]);
      const bool ok = same(c.out[i], want[i]) || (!exactly && err <= tol);
      if (!ok && bad++ < 3)
        std::printf("FAIL %s %s[%" PRId64 "]: %.9g, expected %.9g\n", kind.c_str(), name.c_str(),
                    i, c.out[i], want[i]);
      if (!exactly && want[i] == want[i] && tol > 0) worst = std::max(worst, err / tol);
    }
    failures += bad != 0;
    (kind == "bits" ? exact : twins) += 1;
    if (!bad && !exactly && worst > 0.25)
      std::printf("note %s: %.2f of its tolerance\n", name.c_str(), worst);
  }
  std::printf("%s build (%s): %d twin comparisons, %d bit-exact comparisons, %d failed\n",
              kPaths, kFamily, twins, exact, failures);
  return failures ? 1 : 0;
}

void dump(const std::vector<Case>& cases) {
  for (const auto& c : cases) {
    std::printf("bits %s %s %zu", kFamily, c.name.c_str(), c.out.size());
    for (float x : c.out) std::printf(" %08" PRIx32, bits_of(x));
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("usage: %s EXPECTED | --dump\n", argv[0]);
    return 2;
  }
  const std::vector<Case> cases = all_cases();
  if (std::strcmp(argv[1], "--dump") == 0) {
    dump(cases);
    return 0;
  }
  return check(cases, argv[1]);
}
