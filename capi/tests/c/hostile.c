/* carve's C ABI from C under hostile use: forged handles, double destroy, destroy while blocks
 * are out, null pointers and counts no machine could hold. Exits non-zero on a failure; an
 * abort or crash fails the test that runs it. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "carve.h"

static int failures = 0;
#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            printf("FAIL %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
                   carve_last_error());                                              \
            failures++;                                                              \
        }                                                                            \
    } while (0)

/* xorshift64: forged handle values, the same on every run. */
static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

int main(void) {
    carve_resource_t host = NULL, stats = NULL, out = NULL, dead = NULL;
    CHECK(carve_host_resource_create(&host) == CARVE_OK);
    CHECK(carve_statistics_adaptor_create(host, &stats) == CARVE_OK);
    void *block = NULL;
    CHECK(carve_allocate(stats, 64, 256, NULL, &block) == CARVE_OK);

    /* Forged handles: random values, and live handles with one bit flipped. */
    uint64_t seed = 0x9E3779B97F4A7C15u;
    for (int i = 0; i < 4096; i++) {
        uint64_t v = next(&seed);
        if (i % 2) v = (uint64_t)(uintptr_t)(i % 4 == 1 ? host : stats) ^ (1ull << (v % 64));
        carve_resource_t r = (carve_resource_t)(uintptr_t)v;
        if (r == host || r == stats || r == NULL) continue;
        void *p = NULL;
        CHECK(carve_allocate(r, 64, 256, NULL, &p) == CARVE_ERROR_INVALID_HANDLE && p == NULL);
        CHECK(carve_deallocate(r, block, 64, 256, NULL) == CARVE_ERROR_INVALID_HANDLE);
        CHECK(carve_resource_destroy(r) == CARVE_ERROR_INVALID_HANDLE);
        CHECK(carve_resource_kind(r) == NULL);
        CHECK(carve_pool_resource_create(r, 0, CARVE_SIZE_NONE, &out) ==
              CARVE_ERROR_INVALID_HANDLE);
        CHECK(carve_torch_bind_slot(0, r) == CARVE_ERROR_INVALID_HANDLE);
        CHECK(carve_cupy_malloc((intptr_t)r, 64, 0) == 0);
    }
    CHECK(out == NULL);
    CHECK(carve_live_handles() == 2);

    /* Double destroy, also after the slot was reused: the new handle stays live. */
    CHECK(carve_host_resource_create(&dead) == CARVE_OK);
    CHECK(carve_resource_destroy(dead) == CARVE_OK);
    CHECK(carve_host_resource_create(&out) == CARVE_OK);
    CHECK(carve_resource_destroy(dead) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(carve_resource_kind(out) != NULL && strcmp(carve_resource_kind(out), "host") == 0);
    CHECK(carve_resource_destroy(out) == CARVE_OK);
    CHECK(carve_resource_destroy(out) == CARVE_ERROR_INVALID_HANDLE);

    /* Null pointers. */
    out = NULL;
    CHECK(carve_host_resource_create(NULL) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_pool_resource_create(host, 0, CARVE_SIZE_NONE, NULL) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_allocate(stats, 64, 256, NULL, NULL) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_deallocate(stats, NULL, 64, 256, NULL) == CARVE_ERROR_BAD_POINTER);
    CHECK(carve_resource_stats(stats, NULL, 0, NULL) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_resource_stats(stats, NULL, 4, &(size_t){0}) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_logging_adaptor_create(host, NULL, 0, &out) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_resource_release(NULL, NULL) == CARVE_ERROR_INVALID_HANDLE);
    carve_torch_free(NULL, 0, 0, NULL);
    carve_cupy_free(0, 0, 0);
    carve_ort_free(NULL);
    CHECK(out == NULL);
    CHECK(carve_live_handles() == 2);

    /* Counts and sizes no machine could hold. */
    CHECK(carve_arena_resource_create(host, 0, SIZE_MAX, CARVE_SIZE_NONE, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_arena_resource_create(host, 0, (size_t)1 << 40, CARVE_SIZE_NONE, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_arena_resource_create(host, SIZE_MAX, 1, CARVE_SIZE_NONE, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_pool_resource_create(host, SIZE_MAX, CARVE_SIZE_NONE, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_fixed_size_resource_create(host, SIZE_MAX, 0, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_fixed_size_resource_create(host, 256, 0xFFFFFFFFu, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_binning_resource_create(host, 0, 0xFFFFFFFFu, &out) ==
          CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(out == NULL);

    /* Destroy while a block is out: the block can no longer be freed through the handle, and
     * nothing crashes. */
    CHECK(carve_resource_destroy(stats) == CARVE_OK);
    CHECK(carve_deallocate(stats, block, 64, 256, NULL) == CARVE_ERROR_INVALID_HANDLE);
    /* The upstream handle still owns the block. */
    CHECK(carve_deallocate(host, block, 64, 256, NULL) == CARVE_OK);
    CHECK(carve_resource_destroy(host) == CARVE_OK);
    CHECK(carve_live_handles() == 0);

    if (failures) {
        printf("%d C check(s) failed\n", failures);
        return 1;
    }
    printf("all C checks passed\n");
    return 0;
}
