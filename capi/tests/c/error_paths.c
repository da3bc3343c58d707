/* carve's C ABI from C: error paths and a pool over host memory. Exits non-zero on a failure. */
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

int main(void) {
    void *p = NULL;
    CHECK(carve_allocate(NULL, 64, 256, NULL, &p) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(strstr(carve_last_error(), "null carve resource handle") != NULL);
    CHECK(strcmp(carve_error_name(CARVE_ERROR_INVALID_HANDLE), "CARVE_ERROR_INVALID_HANDLE") == 0);

    carve_resource_t host = NULL, pool = NULL, stats = NULL;
    CHECK(carve_host_resource_create(&host) == CARVE_OK);
    CHECK(carve_pool_resource_create(host, 1 << 20, CARVE_SIZE_NONE, &pool) == CARVE_OK);
    CHECK(carve_statistics_adaptor_create(pool, &stats) == CARVE_OK);
    CHECK(strcmp(carve_resource_kind(stats), "statistics") == 0);

    CHECK(carve_allocate(stats, 0, 256, NULL, &p) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_allocate(stats, 64, 48, NULL, &p) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_allocate(stats, 64, 256, NULL, NULL) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_allocate(stats, 1000, 256, NULL, &p) == CARVE_OK && p != NULL);
    memset(p, 0x5a, 1000);

    carve_stat_t s[16];
    size_t n = 0;
    CHECK(carve_resource_stats(stats, s, 16, &n) == CARVE_OK && n == 6);
    CHECK(strcmp(s[0].name, "current_bytes") == 0 && s[0].value == 1000.0);

    CHECK(carve_deallocate(stats, p, 1000, 256, NULL) == CARVE_OK);
    CHECK(carve_deallocate(host, p, 1000, 256, NULL) == CARVE_ERROR_BAD_POINTER);

    intptr_t c = carve_cupy_malloc((intptr_t)pool, 4096, 0);
    CHECK(c != 0);
    carve_cupy_free((intptr_t)pool, c, 0);
    CHECK(carve_framework_outstanding() == 0);

    /* Chunk sharing: only virtual-memory resources export; bad handles and outputs. */
    int fd = -1;
    void *start = NULL;
    size_t chunk = 0;
    CHECK(carve_allocate(pool, 4096, 256, NULL, &p) == CARVE_OK);
    CHECK(carve_vm_export_chunk(pool, p, &fd, &start, &chunk) == CARVE_ERROR_UNSUPPORTED);
    CHECK(carve_vm_export_chunk(pool, p, NULL, &start, &chunk) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_vm_export_chunk(NULL, p, &fd, &start, &chunk) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(carve_deallocate(pool, p, 4096, 256, NULL) == CARVE_OK);
    carve_chunk_t imported = NULL;
    CHECK(carve_vm_import_chunk(-1, 1 << 21, 0, &imported, &p) == CARVE_ERROR_INVALID_ARGUMENT);
    CHECK(carve_vm_chunk_release(NULL) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(fd == -1 && imported == NULL);

    CHECK(carve_resource_destroy(stats) == CARVE_OK);
    CHECK(carve_resource_destroy(stats) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(carve_allocate(stats, 64, 256, NULL, &p) == CARVE_ERROR_INVALID_HANDLE);
    CHECK(carve_resource_destroy(pool) == CARVE_OK);
    CHECK(carve_resource_destroy(host) == CARVE_OK);
    CHECK(carve_live_handles() == 0);

    if (failures) {
        printf("%d C check(s) failed\n", failures);
        return 1;
    }
    printf("all C checks passed\n");
    return 0;
}
