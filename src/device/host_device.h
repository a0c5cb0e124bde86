// Private: a device whose memory is host memory (cpu, sim). Every kernel operation of
// device_op.h is written here once, as host work (the kernel of kernel.h and host_ops.cc)
// handed to one virtual, execute(): the cpu device runs it at once, sim queues it on the
// stream's worker. Memory, order and transfers stay with each device.
#pragma once
#include <functional>
#include <initializer_list>
#include <utility>

#include "ctxpar/device.h"

namespace ctxpar::device {

class HostDevice : public Device {
 public:
  void run(Stream s, const Op& op) final;
  // The kernel of kernel.h runs here: attention_forward too.
  DeviceCaps caps() const override { return {.whole_forward = true}; }

 protected:
  // One operation's host work, bound by value to its arguments, without a heap allocation:
  // run it now, or keep() a copy to run later.
  class Work {
   public:
    virtual void operator()() const = 0;
    virtual std::function<void()> keep() const = 0;

   protected:
    ~Work() = default;
  };
  using Views = std::initializer_list<TensorView>;

  // Runs `work`, operation `op`, in the order of stream s. `reads` and `writes`: the memory it
  // reads and writes (views; raw bytes as bytes_view), for a device that checks races.
  // Counters: the attention operations add their KernelStats::flops and their time to
  // counters_ inside `work`, when it runs.
  virtual void execute(Stream s, const char* op, Views reads, Views writes, const Work& work) = 0;

  // n bytes at p as a view, to name raw memory in `reads` / `writes`.
  static TensorView bytes_view(const std::byte* p, size_t n);

 private:
  template <typename F>
  class WorkOf final : public Work {
   public:
    explicit WorkOf(F f) : f_(std::move(f)) {}
    void operator()() const override { f_(); }
    std::function<void()> keep() const override { return f_; }

   private:
    F f_;
  };
  template <typename F>
  void submit(Stream s, const char* op, Views reads, Views writes, F f) {
    execute(s, op, reads, writes, WorkOf<F>(std::move(f)));
  }
  // Runs an attention operation (f returns its KernelStats), counting its time and FLOPs.
  template <typename F>
  void busy(F&& f);
  // One specialisation per operation of device_op.h (host_device.cc), for run(): its
  // host work and the memory it reads and writes.
  template <class Args>
  void enqueue(Stream s, const Args& a);
};

// The host work of the operations that are not attention kernels (host_ops.cc).
// y += x (fp32, same shape), element by element in index order.
void host_add(const TensorView& x, const TensorView& y);
void host_fill_zero(const TensorView& t);
// m = -inf, l = 0, acc = 0 (a ForwardState's reset()).
void host_forward_reset(const ForwardStateView& state);
void host_pack_kv(const TensorView& k, const TensorView& v, const Tokens& tokens, bool documents,
                  const TensorView& block_k, const TensorView& block_v, std::byte* block_tokens);
void host_scatter_tokens(const TensorView& src, const TensorView& dst, const TensorView& index);
void host_gather_tokens(const TensorView& src, const TensorView& dst, const TensorView& index);

}  // namespace ctxpar::device
