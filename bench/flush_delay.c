/* LD_PRELOAD shim for the bench's own PostgreSQL: a disk whose flush costs milliseconds.
 *
 * Adds KESTREL_FLUSH_DELAY_US microseconds after every fdatasync() and fsync() the server
 * makes: WAL flushes use fdatasync (wal_sync_method's default on Linux; bench/flushdelay.py
 * refuses a server set otherwise, whose O_DSYNC writes this shim would not slow), checkpoints
 * fsync. sync_file_range() only hints writeback and is left alone. bench/flushdelay.py
 * compiles it with gcc into a cache folder and starts the embedded server with it; nothing
 * else loads it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>

static long delay_us = -1;

static void flush_delay(void) {
    int saved = errno;
    if (delay_us < 0) {
        const char *s = getenv("KESTREL_FLUSH_DELAY_US");
        delay_us = s ? atol(s) : 0;
    }
    if (delay_us > 0) {
        struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
        /* Signals (latch wake-ups) must not cut the delay short. */
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
        }
    }
    errno = saved;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int r = real(fd);
    flush_delay();
    return r;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int r = real(fd);
    flush_delay();
    return r;
}
