/* Per-thread scratch for the kernels: a buffer too large for an OpenMP worker's stack,
 * allocated (64-byte aligned) on the thread's first call, kept for its later calls, freed when
 * the thread exits.
 *
 *     THREAD_SCRATCH(name, bytes)
 *
 * defines `static void *name(int *fresh)`: the calling thread's buffer of `bytes` bytes, or NULL
 * when it cannot be allocated; *fresh (unless fresh is NULL) is set to 1 on the call that
 * allocated it, else 0. */
#ifndef DOCQA_SCRATCH_H
#define DOCQA_SCRATCH_H
#include <pthread.h>
#include <stdlib.h>

#define THREAD_SCRATCH(name, bytes)                                                            \
    static pthread_key_t name##_key;                                                           \
    static pthread_once_t name##_once = PTHREAD_ONCE_INIT;                                     \
    static int name##_key_ok;                                                                  \
    static void name##_make_key(void) {                                                        \
        name##_key_ok = pthread_key_create(&name##_key, free) == 0;                            \
    }                                                                                          \
    static void *name(int *fresh) {                                                            \
        if (fresh) *fresh = 0;                                                                 \
        pthread_once(&name##_once, name##_make_key);                                           \
        if (!name##_key_ok) return NULL;                                                       \
        void *buf = pthread_getspecific(name##_key);                                           \
        if (buf == NULL) {                                                                     \
            buf = aligned_alloc(64, ((bytes) + 63) / 64 * 64);                                 \
            if (buf != NULL && pthread_setspecific(name##_key, buf) != 0) {                    \
                free(buf);                                                                     \
                return NULL;                                                                   \
            }                                                                                  \
            if (fresh) *fresh = buf != NULL;                                                   \
        }                                                                                      \
        return buf;                                                                            \
    }

#endif
