// The instruction-set branches of this build, from the compiler's ISA macros
// (-march=native, or the -march that TANDEM_KERNEL_ISA picks):
//   __AVX512F__                    linear tiles of 12 rows x 32 columns (else
//                                  6 x 16 and 3 x 32, AVX2's 16 registers),
//                                  the float16 screen's 12-row tiles
//   __AVX2__, __F16C__, __FMA__    the greedy head screens (TANDEM_GREEDY_HEAD)
//   __AVX512VNNI__                 the int8 screen on vpdpbusd with 8-bit rows
//                                  (else vpmaddubsw with 6-bit rows)
//   __AMX_TILE__, __AMX_INT8__     its first pass on AMX tiles (TANDEM_AMX_SCREEN),
//                                  where Linux grants the tile state at run time
// No include here: head_amx.cpp tests TANDEM_AMX_SCREEN before it pays for
// ATen's headers.
#pragma once

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define TANDEM_GREEDY_HEAD 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define TANDEM_AMX_SCREEN 1
#endif
#endif
