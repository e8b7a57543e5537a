// Coverage for libFuzzer from GCC's instrumentation, for the targets that include libtorch.
//
// libtorch 1.13's headers do not compile with clang in C++20 mode (std::vector<c10::IValue> is
// used while IValue is incomplete; GCC accepts it, clang does not), so those targets are built
// with g++ -fsanitize-coverage=trace-pc,trace-cmp and linked with clang's libFuzzer. libFuzzer
// no longer counts trace-pc callbacks itself, so run.sh renames GCC's callback in the target's
// object (objcopy --redefine-sym __sanitizer_cov_trace_pc=distrpc_fuzz_trace_pc) and this file
// counts each basic block's return address, hashed into a table of 8-bit counters that it hands
// to libFuzzer as clang's own instrumentation would (AFL's scheme: a collision only merges two
// blocks' counts). The comparison callbacks (trace-cmp) go to libFuzzer unchanged. Built without
// instrumentation.
#include <cstddef>
#include <cstdint>

extern "C" void __sanitizer_cov_8bit_counters_init(std::uint8_t* start, std::uint8_t* stop);
extern "C" void __sanitizer_cov_pcs_init(const std::uintptr_t* begin, const std::uintptr_t* end);

namespace {

constexpr std::size_t kSlots = std::size_t{1} << 16;
alignas(64) std::uint8_t counters[kSlots];
// libFuzzer's table of (pc, flags) per counter: the slot numbers stand in for the addresses.
std::uintptr_t pcs[2 * kSlots];

struct Register {
  Register() {
    for (std::size_t i = 0; i < kSlots; ++i) {
      pcs[2 * i] = i + 1;
      pcs[2 * i + 1] = 0;
    }
    __sanitizer_cov_8bit_counters_init(counters, counters + kSlots);
    __sanitizer_cov_pcs_init(pcs, pcs + 2 * kSlots);
  }
} registered;

}  // namespace

extern "C" void distrpc_fuzz_trace_pc() {
  const auto pc = reinterpret_cast<std::uintptr_t>(__builtin_return_address(0));
  ++counters[(pc ^ (pc >> 16)) & (kSlots - 1)];
}

// GCC's trace-cmp also reports floating-point comparisons, which libFuzzer has no use for.
extern "C" void __sanitizer_cov_trace_cmpf(float, float) {}
extern "C" void __sanitizer_cov_trace_cmpd(double, double) {}
