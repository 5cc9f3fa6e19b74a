/* A wall-clock fault for D14, preloaded into the runtime's processes: CLOCK_REALTIME (and
 * gettimeofday, time) read as the real time plus the seconds written in the file named by
 * KESTREL_FAKE_CLOCK_FILE, re-read on every call so a test can make the clock jump.
 * CLOCK_MONOTONIC is left alone, as an NTP step leaves it.
 *
 * Why not libfaketime: Debian 12's 0.9.10 makes Python's time.sleep fail with EINVAL when
 * it leaves the monotonic clock alone (FAKETIME_DONT_FAKE_MONOTONIC=1), and hangs
 * threading waits when it fakes it; neither models a real clock step. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ns(void) {
    const char *path = getenv("KESTREL_FAKE_CLOCK_FILE");
    char buf[64] = {0};
    if (!path) return 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    return (long long)(strtod(buf, NULL) * 1e9);
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_nsec + offset_ns();
    ts->tv_sec += ns / 1000000000LL;
    ns %= 1000000000LL;
    if (ns < 0) {
        ns += 1000000000LL;
        ts->tv_sec -= 1;
    }
    ts->tv_nsec = ns;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) shift(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
