// The group protocol's decision rules (GatherTable), in one process: who completes a gather,
// what a lost member does to a strict and to a tolerant one, and that every member is handed the
// same outcome however late it asks.
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <distrpc/agent/gather_table.hpp>

using distrpc::detail::GatherOutcome;
using distrpc::detail::GatherTable;
using Status = GatherOutcome::Status;

namespace {

const std::vector<std::string> kNames{"a", "b", "c", "d"};

}  // namespace

TEST_CASE("gather table: completes once every member contributed, with every value") {
  GatherTable t;
  auto fa = t.contribute("k", 0, kNames, false, "barrier", "a", "1", {});
  auto fb = t.contribute("k", 0, kNames, false, "barrier", "b", "2", {});
  auto fc = t.contribute("k", 0, kNames, false, "barrier", "c", "3", {});
  CHECK_FALSE(fa.done());
  CHECK(t.missing("k", 0) == std::vector<std::string>{"d"});
  auto fd = t.contribute("k", 0, kNames, false, "barrier", "d", "4", {});
  for (auto* f : {&fa, &fb, &fc, &fd}) {
    REQUIRE(f->done());
    const GatherOutcome o = f->value();
    CHECK(o.status == Status::ok);
    CHECK(o.values.size() == 4);
    CHECK(o.values.at("c") == "3");
    CHECK(o.lost.empty());
  }
  CHECK(t.missing("k", 0).empty());
}

TEST_CASE("gather table: a strict gather fails at once when a member is lost, naming it") {
  GatherTable t;
  auto fa = t.contribute("k", 0, kNames, false, "barrier", "a", "", {});
  CHECK_FALSE(fa.done());
  t.note_lost("k", 0, {"c"});
  REQUIRE(fa.done());
  const GatherOutcome o = fa.value();
  CHECK(o.status == Status::lost_members);
  CHECK(o.lost == std::vector<std::string>{"c"});
  CHECK(o.text ==
        "barrier failed: worker(s) lost from the group: c (their connections broke or they no "
        "longer answer)");
  // A member arriving later gets the very same outcome, text included.
  auto fb = t.contribute("k", 0, kNames, false, "barrier", "b", "", {});
  REQUIRE(fb.done());
  CHECK(fb.value().text == o.text);
}

TEST_CASE("gather table: a member's own view of the lost counts (it travels with its part)") {
  GatherTable t;
  auto fa = t.contribute("k", 0, kNames, false, "all_gather", "a", "", {});
  auto fb = t.contribute("k", 0, kNames, false, "all_gather", "b", "", {"d", "c"});
  REQUIRE(fa.done());
  CHECK(fa.value().lost == std::vector<std::string>{"c", "d"});
  CHECK(fb.value().text ==
        "all_gather failed: worker(s) lost from the group: c, d (their connections broke or they "
        "no longer answer)");
}

TEST_CASE("gather table: a tolerant gather completes among the survivors and lists the lost") {
  GatherTable t;
  auto fa = t.contribute("k", 0, kNames, true, "shutdown", "a", "x", {});
  t.note_lost("k", 0, {"b"});
  CHECK_FALSE(fa.done());  // c and d are alive and have not contributed yet
  auto fc = t.contribute("k", 0, kNames, true, "shutdown", "c", "y", {});
  CHECK_FALSE(fa.done());
  // d contributed, then died: it counts as contributed, not as lost.
  auto fd = t.contribute("k", 0, kNames, true, "shutdown", "d", "z", {});
  t.note_lost("k", 0, {"d"});
  REQUIRE(fa.done());
  const GatherOutcome o = fa.value();
  CHECK(o.status == Status::ok);
  CHECK(o.lost == std::vector<std::string>{"b"});
  CHECK(o.values.size() == 3);
  CHECK(o.values.count("b") == 0);
  CHECK(fc.value().lost == o.lost);
  CHECK(fd.value().values == o.values);
}

TEST_CASE("gather table: a decided outcome is kept for late askers; sequences are per key") {
  GatherTable t;
  CHECK(t.next_seq("k") == 0);
  CHECK(t.next_seq("k") == 1);
  CHECK(t.next_seq("other") == 0);
  CHECK_FALSE(t.completed("k", 0).has_value());
  // A member records what an earlier leader answered; a new leader can learn it from it.
  GatherOutcome known;
  known.values = {{"a", "1"}};
  t.remember("k", 0, known);
  REQUIRE(t.completed("k", 0).has_value());
  CHECK(t.completed("k", 0)->values == known.values);
  // A new leader that adopts it hands it to its waiters; later decisions change nothing.
  GatherTable leader;
  auto fb = leader.contribute("k", 0, kNames, true, "shutdown", "b", "", {"a"});
  CHECK_FALSE(fb.done());
  leader.decide("k", 0, known);
  REQUIRE(fb.done());
  CHECK(fb.value().values == known.values);
  GatherOutcome late;
  late.status = Status::timed_out;
  leader.decide("k", 0, late);
  CHECK(leader.completed("k", 0)->status == Status::ok);
  // Only the last few outcomes per key are kept.
  for (std::uint64_t s = 1; s <= 8; ++s) t.remember("k", s, known);
  CHECK_FALSE(t.completed("k", 0).has_value());
  CHECK(t.completed("k", 8).has_value());
}

TEST_CASE("gather table: a timeout decision names the members that did not respond") {
  GatherTable t;
  auto fa = t.contribute("k", 0, kNames, false, "barrier", "a", "", {});
  auto fc = t.contribute("k", 0, kNames, false, "barrier", "c", "", {});
  CHECK(t.missing("k", 0) == std::vector<std::string>{"b", "d"});
  GatherOutcome o;
  o.status = Status::timed_out;
  o.text = "timed out: " + distrpc::detail::join_names(t.missing("k", 0));
  t.decide("k", 0, o);
  REQUIRE(fa.done());
  CHECK(fa.value().text == "timed out: b, d");
  CHECK(fc.value().status == Status::timed_out);
  // The gather is closed: nothing is missing any more.
  CHECK(t.missing("k", 0).empty());
}
