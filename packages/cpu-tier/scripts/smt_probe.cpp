// Core-sharing probe (a standalone diagnostic, not part of the package build): are the host's CPUs independent
// cores for port-bound vector code? A virtual machine's vCPUs can be SMT siblings of each other or of another
// guest's vCPUs; two busy siblings share one core's execution ports, so each runs a port-bound loop at about half
// its rate, while a memory-bound stream barely notices.
//
//   g++ -O2 -march=native -pthread packages/cpu-tier/scripts/smt_probe.cpp -o /tmp/smt_probe && /tmp/smt_probe
//
// The loop (csrc/clock_probe.h port_rate, also the bench's probe/vector-ports): 12 independent chains of 512-bit
// vpdpwssd (256-bit vpmaddwd + vpaddd without AVX-512 VNNI), throughput-bound on the two vector ports (as the
// cpu-tier MUL1 kernels are). It prints, in chain steps per ns:
//  * each CPU alone (one thread pinned there, every other CPU idle);
//  * for every pair of CPUs (a, b) busy together, each one's rate relative to its rate alone: a pair at ~0.5/0.5 is
//    one core's two siblings;
//  * every CPU busy at once: each one's rate, their sum, and the sum over (CPU count x median rate alone).
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "../csrc/clock_probe.h"

static double port_loop(double sec) { return cpu_tier_clock::port_rate(sec); }

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

// Run the loop on every CPU of `cpus` at once (started together); rates per CPU.
static std::vector<double> together(const std::vector<int>& cpus, double sec) {
    std::vector<double> r(cpus.size(), 0.0);
    std::atomic<int> ready{0};
    std::vector<std::thread> th;
    for (size_t i = 0; i < cpus.size(); ++i)
        th.emplace_back([&, i] {
            pin(cpus[i]);
            ready.fetch_add(1);
            while (ready.load() < int(cpus.size())) {
            }
            r[i] = port_loop(sec);
        });
    for (auto& t : th) t.join();
    return r;
}

int main() {
    std::vector<int> cpus;
    cpu_set_t s;
    sched_getaffinity(0, sizeof(s), &s);
    for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &s)) cpus.push_back(c);
    const int n = int(cpus.size());
    const double sec = 0.03;
    std::printf("# smt_probe: %d CPUs, %.0f ms per measurement\n", n, sec * 1e3);
    std::vector<double> alone(cpus.size());
    for (int i = 0; i < n; ++i) alone[size_t(i)] = together({cpus[size_t(i)]}, sec)[0];
    std::printf("alone (steps/ns):");
    for (int i = 0; i < n; ++i) std::printf(" %d:%.3f", cpus[size_t(i)], alone[size_t(i)]);
    std::vector<double> sorted = alone;
    std::sort(sorted.begin(), sorted.end());
    const double med = sorted[size_t(n / 2)];
    std::printf("\nmedian alone %.3f\n", med);
    // rel[i][j]: CPU i's rate with j busy too, relative to i alone
    std::vector<std::vector<double>> rel(cpus.size(), std::vector<double>(cpus.size(), 1.0));
    int shared = 0;
    std::printf("pairs (a b: rate of a, rate of b, relative to alone), those below 0.75 on both:\n");
    for (int i = 0; i < n; ++i)
        for (int j = i + 1; j < n; ++j) {
            const auto r = together({cpus[size_t(i)], cpus[size_t(j)]}, sec);
            const double ri = r[0] / alone[size_t(i)], rj = r[1] / alone[size_t(j)];
            rel[size_t(i)][size_t(j)] = ri;
            rel[size_t(j)][size_t(i)] = rj;
            if (ri < 0.75 && rj < 0.75) {
                std::printf("  %d %d: %.2f %.2f\n", cpus[size_t(i)], cpus[size_t(j)], ri, rj);
                ++shared;
            }
        }
    std::printf("pairs sharing a core: %d\nrelative rate (percent) of the row's CPU with the column's busy:\n    ", shared);
    for (int j = 0; j < n; ++j) std::printf("%4d", cpus[size_t(j)]);
    for (int i = 0; i < n; ++i) {
        std::printf("\n%4d", cpus[size_t(i)]);
        for (int j = 0; j < n; ++j) std::printf("%4.0f", 100.0 * rel[size_t(i)][size_t(j)]);
    }
    std::printf("\n");
    for (int rep = 0; rep < 2; ++rep) {
        const auto all = together(cpus, 3 * sec);
        double sum = 0.0;
        std::printf("all %d busy (steps/ns):", n);
        for (int i = 0; i < n; ++i) {
            std::printf(" %d:%.3f", cpus[size_t(i)], all[size_t(i)]);
            sum += all[size_t(i)];
        }
        std::printf("\n  sum %.2f = %.2f x (CPUs x median alone)\n", sum, sum / (n * med));
    }
    return 0;
}
