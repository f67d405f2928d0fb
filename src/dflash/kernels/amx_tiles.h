// AMX tile state shared by the kernels that use tiles (amx_matmul.cpp, int8_matmul.cpp): the tile configuration
// record `_tile_loadconfig` reads, and the permission Linux requires before a process may touch tile data.
// Included only where the including file has decided the build has AMX (and runs on Linux).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include <immintrin.h>

namespace dflash_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads `config` into the tile unit. The compiler does not count LDTILECFG as a read of the record, so without the
// barrier it may drop the stores that fill it (seen with GCC: the tiles were configured from stale stack bytes and
// LDTILECFG faulted).
inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

inline bool request_tile_state() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// Asked once per process; every later call returns the first answer.
inline bool tile_state_granted() {
  static const bool granted = request_tile_state();
  return granted;
}

}  // namespace dflash_amx
