#pragma once
// Ownership handed between threads by the kernel, made visible to ThreadSanitizer.
//
// A connection registered EPOLLONESHOT is read by one thread at a time: the thread that holds it
// re-arms it (epoll_ctl(EPOLL_CTL_MOD)) when it is done, and the next epoll_wait that returns it,
// on any thread, takes it over. The kernel orders the two, but TSan models only EPOLL_CTL_ADD as
// a release, so it would report every later read of the connection's state as a race. The
// holder calls handoff_release(c) before re-arming and the next one handoff_acquire(c) after
// epoll_wait returned it. Both compile to nothing outside a TSan build.

#if defined(__SANITIZE_THREAD__)
#define DISTRPC_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DISTRPC_UNDER_TSAN 1
#endif
#endif

#ifdef DISTRPC_UNDER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace distrpc::net {

inline void handoff_release([[maybe_unused]] const void* object) {
#ifdef DISTRPC_UNDER_TSAN
  __tsan_release(const_cast<void*>(object));
#endif
}

inline void handoff_acquire([[maybe_unused]] const void* object) {
#ifdef DISTRPC_UNDER_TSAN
  __tsan_acquire(const_cast<void*>(object));
#endif
}

}  // namespace distrpc::net
