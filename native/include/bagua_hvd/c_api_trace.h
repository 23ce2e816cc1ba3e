/*
 * bagua_hvd diagnostics: timestamps of the core's collectives (bench/timeline.py). Separate from
 * c_api.h on purpose: not part of the package's API, read by the benchmark with its own cffi
 * declaration of the two functions below.
 */
#ifndef BAGUA_HVD_C_API_TRACE_H
#define BAGUA_HVD_C_API_TRACE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Turns recording on (1) or off (0); returns the previous setting. Off by default. */
int bhvd_trace_enable(int on);

/* Moves up to max_events recorded events, oldest first, into out (4 int64 each: CLOCK_MONOTONIC
 * nanoseconds, op, phase, element count; see native/src/collectives/trace.h) and returns how
 * many; they are removed from the buffer (it keeps the last 4096). */
int bhvd_trace_read(int64_t* out, int max_events);

#ifdef __cplusplus
}
#endif

#endif /* BAGUA_HVD_C_API_TRACE_H */
