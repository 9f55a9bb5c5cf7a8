/* The AMX tile unit's setup, shared by the kernels that use it (included by their sources). */
#ifndef DOCQA_AMX_H
#define DOCQA_AMX_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Asks Linux for the tile state (off until a process asks). 0 when this process may use it. */
static inline int amx_request(void) {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ||
        syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &bits))
        return -1;
    return (bits & (1ul << 18)) ? 0 : -1;
}

/* All eight tiles 64 bytes wide, for this thread (tile state is per thread): the tiles in
 * `short_tiles` (a bit per tile) `rows` rows, the others 16. */
static inline void amx_configure_tiles_rows(unsigned short_tiles, int rows) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(short_tiles >> t & 1 ? rows : 16);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* All eight tiles 16 rows of 64 bytes, for this thread. */
static inline void amx_configure_tiles(void) { amx_configure_tiles_rows(0, 16); }
#endif
