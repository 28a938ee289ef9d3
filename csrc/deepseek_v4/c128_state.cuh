// The online softmax state of DeepSeek-V4's c128 compressor, 4 channels at a
// time: partial softmaxes, merging, one-token updates, and loading / storing a
// slot in its state dtype (float32 or bfloat16, docs/SPEC.md sections 1 and 8).
// Device helpers only: the kernels that use them are c128_decode.cuh,
// c128_prefill.cuh and c128_verify.cuh (speculative verify and commit).
#pragma once

#include <sgl_kernel/type.cuh>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/vec.cuh>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace flash_compress::c128 {

inline constexpr uint32_t kVecWidth = 4;
using Vec = device::AlignedVector<float, kVecWidth>;

template <int64_t kHeadDim>
inline constexpr bool kSupportedHeadDim = kHeadDim >= 64 && kHeadDim <= 1024 && kHeadDim % 64 == 0;

template <typename StateT>
inline constexpr bool kSupportedState = std::is_same_v<StateT, float> || std::is_same_v<StateT, device::bf16_t>;

/// \brief e^x as 2^(x log2 e) on the special-function unit, subnormal
/// results flushed to 0 (e^-inf = 0, as the empty partial needs): two
/// dependent instructions where expf chains eight. A prefill pass of few
/// rows leaves each warp nearly alone on its scheduler, so its pace is the
/// chain of dependent work in each round of tokens, and each token's weight
/// waits on its exponential (head_dim 512, 1 x 2048 + 63 x 1 tokens: 6.94 ->
/// 6.28 us on an H100; cutting a sixth of the instructions off that chain's
/// side, later, bought 1-5%: docs/PERF_LOG.md). Used there (absorb_tokens,
/// where the pass's layout asks for it) and in the merges of token lanes;
/// results moved by at most 3.6e-7 relative to expf's. Single token updates
/// (decode, verify) and the bfloat16 store keep expf.
SGL_DEVICE float exp_approx(float x) {
  constexpr float kLog2E = 1.44269504088896340736f;
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x * kLog2E));
  return result;
}

/// \brief e^x from exp_approx or from expf, as a loop's caller chooses.
template <bool kApprox>
SGL_DEVICE float exp_of(float x) {
  if constexpr (kApprox) {
    return exp_approx(x);
  } else {
    return expf(x);
  }
}

/// \brief Softmax over a set of tokens, per channel, not yet normalised:
/// `max`, `sum = sum_j exp(s_j - max)` and `acc = sum_j exp(s_j - max) * kv_j`.
/// The empty set is (-inf, 0, 0), which every merge treats as a no-op.
struct SoftmaxPartial {
  Vec max, sum, acc;

  SGL_DEVICE static SoftmaxPartial empty() {
    SoftmaxPartial p;
    p.max.fill(-INFINITY);
    p.sum.fill(0.0f);
    p.acc.fill(0.0f);
    return p;
  }
};

/// \brief Adds the first `count` of `kBatch` tokens to `part`. Their maximum
/// is taken first, so the running sums are rescaled once per batch. Tokens
/// past `count` (their values may be anything) are masked by selects, not
/// skipped by branches: a branch per token and channel kept the compiler from
/// overlapping their exponentials, and a warp alone on a long segment waits
/// for each in turn.
template <uint32_t kBatch, bool kApproxExp>
SGL_DEVICE void absorb_tokens(SoftmaxPartial& part, const Vec (&kv)[kBatch], const Vec (&score)[kBatch],
                              uint32_t count) {
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    float batch_max = part.max[c];
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) batch_max = k < count ? fmaxf(batch_max, score[k][c]) : batch_max;
    // batch_max is finite (count >= 1), so an empty part scales by exp(-inf) = 0.
    const float rescale = exp_of<kApproxExp>(part.max[c] - batch_max);
    float sum = part.sum[c] * rescale;
    float acc = part.acc[c] * rescale;
#pragma unroll
    for (uint32_t k = 0; k < kBatch; ++k) {
      const float weight = exp_of<kApproxExp>(score[k][c] - batch_max);
      sum = k < count ? sum + weight : sum;
      acc = k < count ? fmaf(weight, kv[k][c], acc) : acc;
    }
    part.max[c] = batch_max;
    part.sum[c] = sum;
    part.acc[c] = acc;
  }
}

/// \brief `part` re-expressed against `max`, per channel at least its own
/// maximum: its sums scaled by exp(part.max - max). An empty part stays empty
/// (sums 0), also against a `max` of -inf.
SGL_DEVICE void rescale_partial(SoftmaxPartial& part, const Vec& max) {
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    // Against -inf, exp(-inf - -inf) would be NaN; a finite reference keeps
    // an empty part's weight at exp(-inf) = 0.
    const float scale = exp_approx(part.max[c] - (max[c] == -INFINITY ? 0.0f : max[c]));
    part.max[c] = max[c];
    part.sum[c] *= scale;
    part.acc[c] *= scale;
  }
}

/// \brief A stored state `[max | sum | kv]` (kv normalised) for 4 channels.
struct SoftmaxState {
  Vec max, sum, kv;
};

/// \brief The state of `part`'s tokens alone.
SGL_DEVICE SoftmaxState finish_state(const SoftmaxPartial& part) {
  SoftmaxState out;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    out.max[c] = part.max[c];
    out.sum[c] = part.sum[c];
    out.kv[c] = part.acc[c] / part.sum[c];
  }
  return out;
}

/// \brief The state of the tokens of `prior` followed by those of `part`.
SGL_DEVICE SoftmaxState finish_state(const SoftmaxPartial& part, const SoftmaxState& prior) {
  SoftmaxState out;
  Vec weighted_kv;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    const float max = fmaxf(prior.max[c], part.max[c]);
    const float prior_weight = prior.sum[c] * expf(prior.max[c] - max);
    const float part_scale = expf(part.max[c] - max);
    out.max[c] = max;
    out.sum[c] = prior_weight + part.sum[c] * part_scale;
    weighted_kv[c] = prior.kv[c] * prior_weight + part.acc[c] * part_scale;
  }
  // The divisions last, as in add_token below.
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) out.kv[c] = weighted_kv[c] / out.sum[c];
  return out;
}

/// \brief 4 channels of a stored state `[max | sum | kv]` as they sit in the
/// slot (float32 or bfloat16). A kernel that holds a loaded state while other
/// loads are in flight keeps it in this form: bfloat16 takes half the
/// registers until `widen` is called where the values are used. The fields
/// are the 32-bit words the loads return: held as bfloat16 values, each word
/// was first split into two 16-bit registers (a PRMT per value), where as a
/// word a bfloat16 widens with one shift or mask (bf16 decode at head_dim 512:
/// 8 PRMT -> 2, B=4096 2-4% faster on an H100; docs/PERF_LOG.md).
template <typename StateT>
struct StoredState {
  static_assert(kSupportedState<StateT>, "a state is float32 or bfloat16");
  using Field = device::AlignedVector<uint32_t, kVecWidth * sizeof(StateT) / sizeof(uint32_t)>;
  Field max, sum, kv;

  /// \brief `slot` points at the 4 channels' `max`; the fields are `field_stride` elements apart.
  SGL_DEVICE static StoredState load(const StateT* slot, int64_t field_stride) {
    StoredState stored;
    stored.max.load(slot);
    stored.sum.load(slot + field_stride);
    stored.kv.load(slot + 2 * field_stride);
    return stored;
  }

  SGL_DEVICE SoftmaxState widen() const { return SoftmaxState{widen(max), widen(sum), widen(kv)}; }

 private:
  /// A bfloat16 is the high half of the float it widens to, NaN payloads
  /// included; of a word's two channels the even one is the low half.
  SGL_DEVICE static Vec widen(const Field& field) {
    Vec v;
#pragma unroll
    for (uint32_t c = 0; c < kVecWidth; ++c) {
      if constexpr (std::is_same_v<StateT, float>) {
        v[c] = __uint_as_float(field[c]);
      } else {
        const uint32_t word = field[c / 2];
        v[c] = __uint_as_float(c % 2 == 0 ? word << 16 : word & 0xffff0000u);
      }
    }
    return v;
  }
};

/// \brief Loads 4 channels of a stored state, widened to float; `slot` points
/// at their `max`, the fields are `field_stride` elements apart.
template <typename StateT>
SGL_DEVICE SoftmaxState load_state(const StateT* slot, int64_t field_stride) {
  return StoredState<StateT>::load(slot, field_stride).widen();
}

/// \brief Stores 4 channels of a state. A bfloat16 `max` is rounded first and
/// `sum` re-expressed against the rounded value, so the pair still means the
/// same softmax (`max + log(sum)` keeps float32 accuracy); then `sum` and `kv`
/// are rounded to nearest.
template <typename StateT>
SGL_DEVICE void store_state(StateT* slot, int64_t field_stride, const SoftmaxState& state) {
  if constexpr (std::is_same_v<StateT, float>) {
    state.max.store(slot);
    state.sum.store(slot + field_stride);
    state.kv.store(slot + 2 * field_stride);
  } else {
    device::AlignedVector<StateT, kVecWidth> max, sum, kv;
#pragma unroll
    for (uint32_t c = 0; c < kVecWidth; ++c) {
      max[c] = device::cast<StateT>(state.max[c]);
      sum[c] = device::cast<StateT>(state.sum[c] * expf(state.max[c] - device::cast<float>(max[c])));
      kv[c] = device::cast<StateT>(state.kv[c]);
    }
    max.store(slot);
    sum.store(slot + field_stride);
    kv.store(slot + 2 * field_stride);
  }
}


/// \brief The state of one token alone (biased score `s`, value `v`): a chunk's first token.
SGL_DEVICE SoftmaxState first_token_state(const Vec& s, const Vec& v) {
  SoftmaxState out;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    out.max[c] = s[c];
    out.sum[c] = 1.0f;
    out.kv[c] = v[c];
  }
  return out;
}

/// \brief `old` followed by one token (biased score `s`, value `v`).
SGL_DEVICE SoftmaxState add_token(const SoftmaxState& old, const Vec& s, const Vec& v) {
  SoftmaxState out;
  Vec weighted_kv;
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) {
    const float max = fmaxf(old.max[c], s[c]);
    const float old_weight = old.sum[c] * expf(old.max[c] - max);
    const float new_weight = expf(s[c] - max);
    out.max[c] = max;
    out.sum[c] = old_weight + new_weight;
    weighted_kv[c] = old.kv[c] * old_weight + v[c] * new_weight;
  }
  // The divisions come last: each ends in a branch (its slow path), which
  // the compiler does not move work across, so with a division per channel
  // the channels' exponentials ran one channel after another.
#pragma unroll
  for (uint32_t c = 0; c < kVecWidth; ++c) out.kv[c] = weighted_kv[c] / out.sum[c];
  return out;
}

}  // namespace flash_compress::c128
