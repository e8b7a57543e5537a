// The group protocol of an agent: the all-gathers behind barrier, all_gather, wait_all_workers and
// the graceful shutdown, the shutdown's join of every worker's calls, and the steps of a graceful
// shutdown. The decisions are GatherTable's (agent/gather_table.hpp), who is in the group and who
// is lost is the agent's Membership (agent/membership.hpp); this class runs the messages.
//
// An all-gather over a set of members is led by the first member (in name order) not known lost.
// Members send their contribution to the leader, which decides the outcome once and answers
// everyone alike. The leader watches the members it still waits for: one whose connection breaks
// is lost at once, and one that never connected is probed (status) so a dead one is found within
// about a second; a probe also learns the outcome a member already got from an earlier leader
// that died between its replies. A member whose leader is lost goes on with the next one. See
// docs/rpc.md, "When workers are lost".
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/agent.hpp"
#include "distrpc/agent/calls.hpp"
#include "distrpc/agent/elastic.hpp"
#include "distrpc/agent/gather_table.hpp"
#include "distrpc/agent/runtime.hpp"
#include "distrpc/error.hpp"
#include "distrpc/future.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/wire.hpp"

namespace distrpc::detail {

class GroupProtocol {
 public:
  using milliseconds = std::chrono::milliseconds;

  explicit GroupProtocol(std::shared_ptr<RpcAgent> agent) : agent_(std::move(agent)) {}

  // One gather of `blob` over `names` (empty: every worker). Strict (`tolerant` false): fails
  // with a DistNetworkError naming the members lost before they contributed. Tolerant: completes
  // among the survivors and lists the lost ones. Either way the outcome is the same on every
  // member, and the lost members are marked lost here too.
  GatherOutcome gather(std::string blob, std::vector<std::string> names, milliseconds timeout,
                       bool tolerant, const std::string& op) {
    using Clock = std::chrono::steady_clock;
    const std::string me = agent_->self().name;
    if (names.empty()) {
      for (const auto& w : agent_->workers()) names.push_back(w.name);
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    if (!std::binary_search(names.begin(), names.end(), me)) {
      throw std::invalid_argument("all_gather: this worker (" + me +
                                  ") is not in the list of participants");
    }
    for (const auto& n : names) agent_->worker(n);  // unknown names fail here, clearly
    std::string key;
    for (const auto& n : names) key += n + ",";
    const std::uint64_t seq = agent_->gathers().next_seq(key);
    const auto limit = agent_->effective_timeout(timeout);
    const auto deadline = limit.count() > 0 ? Clock::now() + limit : Clock::time_point::max();
    GatherOutcome out;
    for (;;) {
      const auto lost = lost_among(names);
      const std::string leader =
          *std::find_if(names.begin(), names.end(), [&](const std::string& n) {
            return n == me || !std::binary_search(lost.begin(), lost.end(), n);
          });
      if (leader == me) {
        out = lead(key, seq, names, tolerant, op, std::move(blob), deadline, limit);
        break;
      }
      // The leader's verdict comes first: the member's own limit is a little longer, so it fires
      // only when the leader itself does not answer.
      milliseconds call_limit{0};
      if (limit.count() > 0) {
        const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
        call_limit = std::max(left, milliseconds(1)) + std::max(milliseconds(1000), limit / 2);
      }
      // The library's own: served by every agent (Registrar's `Library`).
      ensure_library_registered<&GroupProtocol::contribute>();
      auto reply = send_call<&GroupProtocol::contribute>(
                       agent_, agent_->worker(leader), CallOptions{call_limit},
                       /*internal=*/true, key, seq, names, tolerant, op, me, blob, lost)
                       .reply;
      try {
        wire::decode(reply.value(), out);
      } catch (const DistNetworkError& e) {
        // The leader's verdicts are values: a network error means the leader is gone. The next
        // member in name order leads the same gather.
        agent_->mark_lost(agent_->worker(leader).id, e.what());
        continue;
      }
      agent_->gathers().remember(key, seq, out);
      break;
    }
    for (const auto& n : out.lost) {
      agent_->mark_lost(agent_->worker(n).id, "lost during " + op + " (reported by the group)");
    }
    if (out.status == GatherOutcome::Status::lost_members) throw DistNetworkError(out.text);
    if (out.status == GatherOutcome::Status::timed_out) throw RpcTimeoutError(out.text);
    return out;
  }

  // A strict gather of opaque blobs: {name: blob}.
  std::map<std::string, std::string> all_gather(std::string blob, std::vector<std::string> names,
                                                milliseconds timeout,
                                                const std::string& op = "all_gather") {
    return gather(std::move(blob), std::move(names), timeout, /*tolerant=*/false, op).values;
  }

  // Group-wide join among the surviving members: repeat (tolerant) gathers of the work counters
  // until two consecutive rounds agree, on the totals and on who is lost, and show every sent
  // call answered and no call running anywhere. Monotonic counters make a call that slips
  // between two workers' reports change the totals, so it cannot go unseen. A lost member's
  // calls end on the survivors (they fail naming it), so the survivors' totals balance without
  // it. Returns the lost members.
  std::vector<std::string> join_work(const std::function<milliseconds()>& time_left) {
    std::optional<WorkCounters> previous;
    std::vector<std::string> previous_lost;
    while (true) {
      auto round =
          gather(to_blob(agent_->counters()), {}, time_left(), /*tolerant=*/true, "shutdown");
      WorkCounters total;
      for (auto& [n, b] : round.values) {
        auto c = from_blob<WorkCounters>(std::move(b));
        total.client_sent += c.client_sent;
        total.client_done += c.client_done;
        total.server_active += c.server_active;
        total.protocol_pending += c.protocol_pending;
      }
      const bool idle = total.client_sent == total.client_done && total.server_active == 0 &&
                        total.protocol_pending == 0;
      if (idle && previous && *previous == total && previous_lost == round.lost) return round.lost;
      previous = total;
      previous_lost = round.lost;
      if (!idle) std::this_thread::sleep_for(milliseconds(1));
    }
  }

  // shutdown() of this agent (docs/rpc.md): graceful, the group's steps, then the local stop.
  // Returns the error to raise once the caller has forgotten the agent, or null.
  std::exception_ptr shutdown(bool graceful, milliseconds timeout) {
    // A dynamic group's member leaves it: no group-wide steps (agent/elastic.hpp).
    if (agent_->dynamic()) return ElasticProtocol(agent_).leave(graceful, timeout);
    std::exception_ptr error;
    std::exception_ptr leak_error;  // reported after a complete (synchronized) local stop
    std::vector<std::string> lost;  // agreed by the group: reported after the local stop
    bool led_last = false;          // this worker decided the group's last gather
    if (graceful) {
      try {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        // What is left of `timeout` (0, no limit, stays 0); at least 1 ms so a late step times
        // out with its own text instead of waiting without limit.
        const auto time_left = [&]() -> milliseconds {
          if (timeout.count() <= 0) return timeout;
          return std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(
                                               deadline - std::chrono::steady_clock::now()));
        };
        gather(std::string(), {}, time_left(), /*tolerant=*/true, "shutdown");
        lost = join_work(time_left);
        // The layers release what this worker holds of others (RRefs: every user RRef).
        auto limit = timeout.count() > 0 ? time_left() : agent_->default_timeout();
        if (limit.count() == 0) limit = std::chrono::seconds(60);
        for (const auto& x : agent_->extensions()) x->before_exit(limit);
        // Every worker's releases are answered before anyone checks for leaks.
        const auto last = gather(std::string(), {}, time_left(), /*tolerant=*/true, "shutdown");
        lost = last.lost;
        led_last = last.led;
        if (auto leaks = agent_->extension_leaks(); leaks && !leak_error) leak_error = leaks;
      } catch (...) {
        error = std::current_exception();
      }
    }
    try {
      agent_->stop(graceful && !error, timeout, led_last);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    if (error) return error;
    if (!lost.empty()) return std::make_exception_ptr(DistNetworkError(lost_text(lost)));
    return leak_error;
  }

  // The error of a graceful shutdown that completed among the survivors of a group that lost
  // members: the same text on every survivor.
  static std::string lost_text(const std::vector<std::string>& lost) {
    return "shutdown: worker(s) lost from the group: " + join_names(lost) +
           "; the other workers completed their outstanding calls and stopped";
  }

  // ---- what members call on the leader (internal calls, asynchronous by type) ------------------
  static Future<GatherOutcome> contribute(std::string key, std::uint64_t seq,
                                          std::vector<std::string> names, bool tolerant,
                                          std::string op, std::string name, std::string blob,
                                          std::vector<std::string> lost) {
    return current_agent()->gathers().contribute(key, seq, names, tolerant, op, name,
                                                 std::move(blob), lost);
  }
  // A leader asks a member that has not contributed: the outcome, if the member already has it.
  static std::optional<GatherOutcome> status(std::string key, std::uint64_t seq) {
    return current_agent()->gathers().completed(key, seq);
  }

  template <class V>
  static std::string to_blob(const V& value) {
    wire::Message m;
    wire::encode(m, value);
    if (!m.buffers.empty()) {
      throw std::invalid_argument(
          "all_gather: values carrying tensors are not supported; gather plain data");
    }
    return std::move(m.payload);
  }
  template <class V>
  static V from_blob(std::string blob) {
    wire::Message m;
    m.payload = std::move(blob);
    V v{};
    wire::decode(m, v);
    return v;
  }

 private:
  static std::string seconds_text(milliseconds t) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(t.count()) / 1000.0);
    return buf;
  }

  // The members of `names` known lost here.
  std::vector<std::string> lost_among(const std::vector<std::string>& names) const {
    std::vector<std::string> out;
    for (const auto& n : agent_->lost_names()) {
      if (std::binary_search(names.begin(), names.end(), n)) out.push_back(n);
    }
    return out;
  }

  // The leader's side of one gather: contributes, then waits for the others, watching and
  // probing the missing ones, until the table decides or `deadline` passes.
  GatherOutcome lead(const std::string& key, std::uint64_t seq,
                     const std::vector<std::string>& names, bool tolerant, const std::string& op,
                     std::string blob, std::chrono::steady_clock::time_point deadline,
                     milliseconds limit) {
    using Clock = std::chrono::steady_clock;
    auto& table = agent_->gathers();
    auto fut = table.contribute(key, seq, names, tolerant, op, agent_->self().name, std::move(blob),
                                lost_among(names));
    struct Probe {
      Clock::time_point next;
      milliseconds interval{100};
      std::optional<Future<wire::Message>> pending;
    };
    std::map<std::string, Probe> probes;
    while (!fut.wait_for(milliseconds(10))) {
      table.note_lost(key, seq, lost_among(names));
      const auto now = Clock::now();
      if (now >= deadline) {
        GatherOutcome o;
        o.status = GatherOutcome::Status::timed_out;
        o.text = "timed out in _all_gather after " + seconds_text(limit) +
                 " seconds. The following workers did not respond: " +
                 join_names(table.missing(key, seq));
        table.decide(key, seq, std::move(o));
        continue;
      }
      for (const auto& m : table.missing(key, seq)) {
        auto [it, fresh] = probes.try_emplace(m);
        Probe& p = it->second;
        if (fresh) p.next = now + p.interval;  // most members arrive on their own, unprobed
        if (p.pending && p.pending->done()) {
          try {
            std::optional<GatherOutcome> known;
            wire::decode(p.pending->value(), known);
            if (known) table.decide(key, seq, std::move(*known));
          } catch (const DistNetworkError& e) {
            agent_->mark_lost(agent_->worker(m).id, e.what());
          } catch (const std::exception&) {
            // A slow answer (timeout) or a member shutting down: asked again at the next turn.
          }
          p.pending.reset();
        }
        if (!p.pending && now >= p.next) {
          ensure_library_registered<&GroupProtocol::status>();
          p.pending = send_call<&GroupProtocol::status>(agent_, agent_->worker(m),
                                                        CallOptions{milliseconds(2000)},
                                                        /*internal=*/true, key, seq)
                          .reply;
          p.interval = std::min(p.interval * 2, milliseconds(1000));
          p.next = now + p.interval;
        }
      }
    }
    GatherOutcome out = fut.value();
    out.led = true;
    return out;
  }

  const std::shared_ptr<RpcAgent> agent_;
};

}  // namespace distrpc::detail
