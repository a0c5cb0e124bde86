#include <gtest/gtest.h>

#include <cstdint>

#include "ctxpar/comm.h"

namespace ctxpar {
namespace {

TEST(Buffer, IsZeroFilledAndAligned) {
  for (size_t bytes : {size_t(1), size_t(63), size_t(64), size_t(1000003)}) {
    Buffer b(bytes);
    ASSERT_EQ(b.size(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(b.as<unsigned char>()[i], 0) << i;
  }
}

TEST(Buffer, MovesWithoutCopying) {
  Buffer a(256);
  a.as<float>()[3] = 1.5f;
  std::byte* where = a.data();
  Buffer b = std::move(a);
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(b.as<float>()[3], 1.5f);
  EXPECT_EQ(b.size(), 256u);
  EXPECT_EQ(a.size(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_TRUE(a.empty());
  Buffer empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.data(), nullptr);
  Buffer zero(0);
  EXPECT_TRUE(zero.empty());
}

TEST(Buffer, UninitializedHasSizeAndAlignment) {
  Buffer b = Buffer::uninitialized(1000);
  EXPECT_EQ(b.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  EXPECT_TRUE(Buffer::uninitialized(0).empty());
}

TEST(Request, EmptyRequestIsCompleteAndTakesNothing) {
  Request r;
  EXPECT_FALSE(r.valid());
  EXPECT_TRUE(r.test());
  r.wait();
  EXPECT_TRUE(r.take().empty());
}

// Note [A failed request fails at once after]: a wait that threw (here: a timeout) is not
// waited again; test, wait and take rethrow the first error. The old Request called the
// transport's wait again, which waited out the whole timeout a second time.
TEST(Request, AFailedRequestFailsAtOnceAfterWithTheSameError) {
  struct TimingOut final : Request::Impl {
    int* waits;
    explicit TimingOut(int* w) : waits(w) {}
    bool test() override { return false; }
    void wait() override {
      ++*waits;
      throw Error("rank 0: timed out after 1 s waiting for recv from rank 1 (tag 1)");
    }
  };
  int waits = 0;
  Request r(std::make_unique<TimingOut>(&waits));
  std::string first;
  try {
    r.wait();
  } catch (const Error& e) {
    first = e.what();
  }
  EXPECT_EQ(first, "rank 0: timed out after 1 s waiting for recv from rank 1 (tag 1)");
  for (int i = 0; i < 3; ++i) {
    try {
      if (i == 0)
        r.wait();
      else if (i == 1)
        r.take();
      else
        r.test();
      ADD_FAILURE() << "call " << i << " after the failure did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), first) << "call " << i;
    }
  }
  EXPECT_EQ(waits, 1) << "the transport's wait ran again after it had failed";
  EXPECT_TRUE(r.valid());
}

TEST(CommKind, HasNames) {
  EXPECT_STREQ(comm_kind_name(CommKind::reduce_scatter), "reduce_scatter");
  EXPECT_STREQ(comm_kind_name(CommKind::send), "send");
  EXPECT_STREQ(comm_kind_name(CommKind::barrier), "barrier");
}

}  // namespace
}  // namespace ctxpar
