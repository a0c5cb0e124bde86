// Private: a device whose memory is host memory (cpu, sim). Every kernel operation of
// device.h is written here once, as host work (the kernel of kernel.h and host_ops.cc) handed
// to one virtual, run(): the cpu device runs it at once, sim queues it on the stream's worker.
// Memory, order and transfers stay with each device.
#pragma once
#include <functional>
#include <initializer_list>
#include <utility>

#include "ctxpar/device.h"

namespace ctxpar::device {

class HostDevice : public Device {
 public:
  void forward_reset(Stream s, const ForwardStateView& state) final;
  void forward_block(Stream s, const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const ForwardStateView& state, const KernelConfig& config) final;
  void forward_finalize(Stream s, const ForwardStateView& state, const TensorView& out,
                        const TensorView& lse, const KernelConfig& config) final;
  void backward_delta(Stream s, const TensorView& out, const TensorView& dout,
                      const TensorView& delta, const KernelConfig& config) final;
  void backward_block(Stream s, const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                      const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                      const TensorView& dout, const TensorView& lse, const TensorView& delta,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const KernelConfig& config) final;
  void merge(Stream s, const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
             const TensorView& lse_b) final;
  void add(Stream s, const TensorView& x, const TensorView& y) final;
  void copy(Stream s, const TensorView& src, const TensorView& dst) final;
  void fill_zero(Stream s, const TensorView& t) final;
  void pack_kv(Stream s, const TensorView& k, const TensorView& v, const Tokens& tokens,
               bool documents, const TensorView& block_k, const TensorView& block_v,
               std::byte* block_tokens) final;
  void scatter_tokens(Stream s, const TensorView& src, const TensorView& dst,
                      const TensorView& index) final;
  void gather_tokens(Stream s, const TensorView& src, const TensorView& dst,
                     const TensorView& index) final;

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
  virtual void run(Stream s, const char* op, Views reads, Views writes, const Work& work) = 0;

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
    run(s, op, reads, writes, WorkOf<F>(std::move(f)));
  }
  // Runs an attention operation (f returns its KernelStats), counting its time and FLOPs.
  template <typename F>
  void busy(F&& f);
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
