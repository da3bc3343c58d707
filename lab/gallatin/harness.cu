// Gallatin (saltsystemslab/gallatin) on the workload of `carve bench device-alloc`, which builds
// this file with nvcc against a checkout the user names (`--gallatin DIR`, `-I DIR/include`) and
// runs it once per row. Timing as carve's rows: one kernel of N threads, one request each, 256
// threads per block, on one stream, between two events; one untimed run, then the median of
// `--runs` timed runs. Allocation is timed with a free of its blocks between runs, free with an
// allocation between runs, so that each free starts from a full set of blocks.
//
//   harness --n N (--size BYTES | --max BYTES --seed SEED) --heap-bytes BYTES --runs R
//
// prints one line, `carve-gallatin key=value ...`, with alloc_ms, free_ms (medians) and failed
// (null pointers over every allocation launch). Errors go to stderr with a non-zero exit.

#include <gallatin/allocators/gallatin.cuh>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// The configuration measured beside carve: 16 MiB segments, slices of 16 B to 4 KiB.
using gallatin_type = gallatin::allocators::Gallatin<16ULL * 1024 * 1024, 16ULL, 4096ULL>;

// Threads per block, as carve's launches.
constexpr unsigned kBlock = 256;
// The seed of Gallatin's own trees, as its tests use.
constexpr uint64_t kTreeSeed = 42;

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "carve-gallatin: %s: %s\n", #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// carve_kernels::general::bench_request_size: 16 B + hash(i, seed) % (max - 15).
__host__ __device__ inline uint64_t mix(uint64_t i, uint32_t seed) {
  uint64_t x = (i ^ (static_cast<uint64_t>(seed) << 32)) * 0x9E3779B97F4A7C15ULL;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ULL;
  return x ^ (x >> 32);
}

__host__ __device__ inline uint64_t request_size(uint64_t i, uint32_t seed, uint64_t max) {
  return 16 + mix(i, seed) % (max - 15);
}

__device__ inline uint64_t thread_index() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Thread i < n allocates `bytes` into out[i] (0 on failure).
__global__ void alloc_one(gallatin_type* g, uint64_t* out, uint64_t n, uint64_t bytes) {
  uint64_t i = thread_index();
  if (i >= n) return;
  out[i] = reinterpret_cast<uint64_t>(g->malloc(bytes));
}

// Thread i < n allocates request_size(i, seed, max) bytes into out[i] (0 on failure).
__global__ void alloc_mixed(gallatin_type* g, uint64_t* out, uint64_t n, uint64_t max,
                            uint32_t seed) {
  uint64_t i = thread_index();
  if (i >= n) return;
  out[i] = reinterpret_cast<uint64_t>(g->malloc(request_size(i, seed, max)));
}

// Thread i < n frees ptrs[i] unless it is null (Gallatin's free takes no null).
__global__ void free_all(gallatin_type* g, const uint64_t* ptrs, uint64_t n) {
  uint64_t i = thread_index();
  if (i >= n) return;
  uint64_t p = ptrs[i];
  if (p != 0) g->free(reinterpret_cast<void*>(p));
}

// Adds the null entries of ptrs[0..n) to *count (untimed: after each allocation launch).
__global__ void count_nulls(const uint64_t* ptrs, uint64_t n, unsigned long long* count) {
  uint64_t i = thread_index();
  if (i >= n) return;
  if (ptrs[i] == 0) atomicAdd(count, 1ULL);
}

struct Options {
  uint64_t n = 0;
  uint64_t size = 0;
  uint64_t max = 0;
  uint32_t seed = 1;
  uint64_t heap_bytes = 0;
  int runs = 5;
};

static void usage(const char* why) {
  std::fprintf(stderr,
               "carve-gallatin: %s\nusage: harness --n N (--size BYTES | --max BYTES --seed "
               "SEED) --heap-bytes BYTES --runs R\n",
               why);
  std::exit(2);
}

static uint64_t number(const char* flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || text[0] == '-') {
    std::fprintf(stderr, "carve-gallatin: %s: not a number: %s\n", flag, text);
    std::exit(2);
  }
  return v;
}

static Options parse(int argc, char** argv) {
  Options o;
  for (int k = 1; k < argc; k += 2) {
    if (k + 1 >= argc) usage("a flag without its value");
    const char* flag = argv[k];
    uint64_t v = number(flag, argv[k + 1]);
    if (std::strcmp(flag, "--n") == 0) {
      o.n = v;
    } else if (std::strcmp(flag, "--size") == 0) {
      o.size = v;
    } else if (std::strcmp(flag, "--max") == 0) {
      o.max = v;
    } else if (std::strcmp(flag, "--seed") == 0) {
      if (v > UINT32_MAX) usage("--seed must fit 32 bits");
      o.seed = static_cast<uint32_t>(v);
    } else if (std::strcmp(flag, "--heap-bytes") == 0) {
      o.heap_bytes = v;
    } else if (std::strcmp(flag, "--runs") == 0) {
      if (v < 1 || v > 1000) usage("--runs must be 1 to 1000");
      o.runs = static_cast<int>(v);
    } else {
      usage("unknown flag");
    }
  }
  if (o.n == 0 || o.n > (static_cast<uint64_t>(UINT32_MAX) * kBlock)) usage("--n out of range");
  if ((o.size == 0) == (o.max == 0)) usage("give one of --size and --max");
  if (o.max != 0 && o.max < 16) usage("--max must be at least 16");
  if (o.heap_bytes == 0) usage("--heap-bytes is required");
  return o;
}

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  const unsigned grid = static_cast<unsigned>((o.n + kBlock - 1) / kBlock);
  // Gallatin's set-up does not check its CUDA calls: fail here first without a device.
  int devices = 0;
  CHECK(cudaGetDeviceCount(&devices));
  if (devices == 0) usage("no CUDA device");

  gallatin_type* g = gallatin_type::generate_on_device(o.heap_bytes, kTreeSeed, false);
  uint64_t* out = nullptr;
  unsigned long long* nulls = nullptr;
  CHECK(cudaMalloc(&out, o.n * sizeof(uint64_t)));
  CHECK(cudaMalloc(&nulls, sizeof(unsigned long long)));
  CHECK(cudaMemset(out, 0, o.n * sizeof(uint64_t)));
  CHECK(cudaMemset(nulls, 0, sizeof(unsigned long long)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  CHECK(cudaDeviceSynchronize());

  auto alloc = [&] {
    if (o.size != 0) {
      alloc_one<<<grid, kBlock, 0, s>>>(g, out, o.n, o.size);
    } else {
      alloc_mixed<<<grid, kBlock, 0, s>>>(g, out, o.n, o.max, o.seed);
    }
    CHECK(cudaGetLastError());
  };
  auto count = [&] {
    count_nulls<<<grid, kBlock, 0, s>>>(out, o.n, nulls);
    CHECK(cudaGetLastError());
  };
  auto counted_alloc = [&] {
    alloc();
    count();
  };
  auto free_ = [&] {
    free_all<<<grid, kBlock, 0, s>>>(g, out, o.n);
    CHECK(cudaGetLastError());
  };
  auto nothing = [] {};

  // Median ms of `runs` launches of `body` between events, after one untimed; `after` runs
  // untimed right after each body, `between` untimed before the next.
  auto median_ms = [&](auto body, auto after, auto between) {
    body();
    after();
    between();
    std::vector<float> ms;
    for (int r = 0; r < o.runs; ++r) {
      CHECK(cudaEventRecord(start, s));
      body();
      CHECK(cudaEventRecord(end, s));
      after();
      CHECK(cudaEventSynchronize(end));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, end));
      ms.push_back(t);
      between();
    }
    std::sort(ms.begin(), ms.end());
    return ms[o.runs / 2];
  };

  float alloc_ms = median_ms(alloc, count, free_);
  counted_alloc();
  float free_ms = median_ms(free_, nothing, counted_alloc);
  free_();
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaGetLastError());
  unsigned long long failed = 0;
  CHECK(cudaMemcpy(&failed, nulls, sizeof(failed), cudaMemcpyDeviceToHost));

  std::printf(
      "carve-gallatin n=%" PRIu64 " size=%" PRIu64 " max=%" PRIu64 " seed=%u heap_bytes=%" PRIu64
      " runs=%d alloc_ms=%.6f free_ms=%.6f failed=%llu\n",
      o.n, o.size, o.max, o.seed, o.heap_bytes, o.runs, alloc_ms, free_ms, failed);

  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaFree(out));
  CHECK(cudaFree(nulls));
  gallatin_type::free_on_device(g);
  return 0;
}
