// Whether this build runs under a sanitizer. AddressSanitizer and ThreadSanitizer reserve
// terabytes of address space for their shadow memory, so a test that lowers RLIMIT_AS
// (ulimit -v) cannot run under them: such a test calls CTXPAR_SKIP_UNDER_SANITIZER() first.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CTXPAR_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CTXPAR_UNDER_SANITIZER 1
#endif
#endif
#ifndef CTXPAR_UNDER_SANITIZER
#define CTXPAR_UNDER_SANITIZER 0
#endif

#define CTXPAR_SKIP_UNDER_SANITIZER()                                             \
  do {                                                                            \
    if (CTXPAR_UNDER_SANITIZER)                                                   \
      GTEST_SKIP() << "lowers RLIMIT_AS (ulimit -v), which AddressSanitizer and " \
                      "ThreadSanitizer cannot run under";                         \
  } while (0)
