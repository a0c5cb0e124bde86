// Note [One call frame] (ctxpar/strategy.h): create(), and forward / backward written once for
// every algorithm -- check, agree, record, run, check the outputs.
#include <deque>
#include <functional>
#include <vector>

#include "ctxpar/agreement.h"
#include "device/kernel_agreement.h"
#include "strategy/internal.h"

namespace ctxpar {
namespace strategy {

// The checks read arguments and results on the host; those a device holds in place in memory
// the host cannot read (Device::host_readable: the cuda device's adopted CUDA tensors) are
// checked in a host copy the device makes (views whose last dim is not contiguous are left
// as they are: their check fails on the stride before it reads anything).
class HostViews {
 public:
  explicit HostViews(Device& device) : device_(device) {}
  TensorView operator()(const TensorView& v) {
    if (v.empty() || device_.host_readable(v.data())) return v;
    if (v.ndim() == 4 && v.dim(3) > 1 && v.stride(3) != 1) return v;
    copies_.emplace_back(v.dtype(), v.shape());
    device_.copy(kComputeStream, v, copies_.back().view());
    return copies_.back().view();
  }
  // Waits for the copies (none: nothing to wait for).
  void ready() {
    if (!copies_.empty()) device_.synchronize();
  }

 private:
  Device& device_;
  std::deque<Tensor> copies_;
};

}  // namespace strategy

Strategy::Strategy(Communicator& comm, const StrategyOptions& options,
                   std::unique_ptr<Device> device)
    : comm_(comm),
      options_(options),
      device_(device ? std::move(device) : make_device(options.device, comm.rank())) {}

std::unique_ptr<Strategy> Strategy::create(Communicator& comm, const StrategyOptions& options) {
  return create(comm, options, nullptr);
}

std::unique_ptr<Strategy> Strategy::create(Communicator& comm, const StrategyOptions& options,
                                           std::unique_ptr<Device> device) {
  // Options are checked here and agreed on by every rank before hybrid's split (a collective).
  std::string error;
  const int p = comm.size();
  if (options.ulysses_degree < 0)
    error = detail::concat("ulysses_degree: expected >= 0 (0 = P), got ", options.ulysses_degree);
  else if (options.kind == StrategyKind::hybrid && options.ulysses_degree > 0 &&
           p % options.ulysses_degree != 0)
    error = detail::concat("hybrid: ulysses_degree u = ", options.ulysses_degree,
                           " must divide the number of ranks P = ", p,
                           " (ulysses groups of u ranks x ring over P/u groups)");
  else if (options.head_groups < 0)
    error = detail::concat("head_groups: expected >= 0 (0 = auto), got ", options.head_groups);
  else if (options.ulysses_groups < 0 || options.ulysses_groups > kMaxUlyssesGroups)
    error = detail::concat("ulysses_groups: expected 0 (the default) or 1..", kMaxUlyssesGroups,
                           " (the most head groups Ulysses pipelines its all-to-alls over), got ",
                           options.ulysses_groups);
  else if (options.exchange == Exchange::needed && !has_needed_exchange(options.kind))
    error = detail::concat(
        "exchange = needed: only the ring and allgather strategies send each rank only the "
        "K/V it needs (",
        strategy_name(options.kind), " moves every token); use exchange = auto or ring with ",
        strategy_name(options.kind), ", or strategy = ring or allgather");
  else if (options.kernel.threads < 1)
    error = detail::concat("kernel.threads: expected >= 1, got ", options.kernel.threads);
  else
    error = device::kernel_choices_error(options.kernel);
  require_agreement(comm, std::string(strategy_name(options.kind)) + " create",
                    strategy::signature_of(strategy::Dims{}, options), error);
  StrategyOptions agreed = options;
  agreed.exchange = exchange_of(options);             // the same on every rank: the options agree
  device::agree_kernel_choices(comm, agreed.kernel);  // before hybrid splits: the whole job
  switch (agreed.kind) {
    case StrategyKind::ring:
      return strategy::make_ring(comm, agreed, std::move(device));
    case StrategyKind::allgather:
      return strategy::make_allgather(comm, agreed, std::move(device));
    case StrategyKind::ulysses:
      return strategy::make_ulysses(comm, agreed, std::move(device));
    case StrategyKind::hybrid:
      return strategy::make_hybrid(comm, agreed, std::move(device));
  }
  throw Error("unknown strategy kind");
}

void Strategy::in_frame(const char* call, const strategy::Dims& dims, std::string error,
                        const std::function<void(strategy::Call&)>& run,
                        const std::function<void(const std::string&)>& check_outputs) {
  const std::string what = std::string(strategy_name(options_.kind)) + " " + call;
  if (error.empty()) error = check_heads(dims.hq, dims.hkv);
  require_agreement(comm_, what, strategy::signature_of(dims, options_), error);
  stats_ = StrategyStats{};
  strategy::CallRecord record(*device_, counted());
  strategy::Call frame{dims, device_.get(), options_.mask, options_.kernel};
  run(frame);
  const strategy::CallMeasure m = record.finish();
  stats_.attention_flops = m.device.flops;
  stats_.busy_seconds = m.device.busy_seconds;
  stats_.wall_seconds = m.wall_seconds;
  stats_.comm_wait_seconds = m.device.wait_seconds + frame.host_wait_seconds;
  stats_.bytes_sent = m.bytes_sent;
  stats_.bytes_received = m.bytes_received;
  stats_.peak_bytes = m.peak_bytes;
  check_outputs(what);
}

void Strategy::forward(const ForwardArgs& args) {
  strategy::Dims dims;
  std::string error;
  {
    strategy::HostViews host(*device_);
    ForwardArgs checked = args;
    checked.q = host(args.q), checked.k = host(args.k), checked.v = host(args.v);
    host.ready();
    error = strategy::check_forward(checked, options_.mask, dims);
  }
  in_frame(
      "forward", dims, std::move(error), [&](strategy::Call& call) { run_forward(args, call); },
      [&](const std::string& what) {
        strategy::HostViews host(*device_);
        const TensorView out = host(args.out), lse = host(args.lse);
        host.ready();
        strategy::agree_outputs(comm_, what,
                                strategy::check_forward_outputs(out, lse, args.tokens));
      });
}

void Strategy::backward(const BackwardArgs& args) {
  strategy::Dims dims;
  std::string error;
  {
    strategy::HostViews host(*device_);
    BackwardArgs checked = args;
    checked.q = host(args.q), checked.k = host(args.k), checked.v = host(args.v);
    checked.dout = host(args.dout);
    host.ready();
    error = strategy::check_backward(checked, options_.mask, dims);
  }
  in_frame(
      "backward", dims, std::move(error), [&](strategy::Call& call) { run_backward(args, call); },
      [&](const std::string& what) {
        strategy::HostViews host(*device_);
        const TensorView dq = host(args.dq), dk = host(args.dk), dv = host(args.dv);
        host.ready();
        strategy::agree_outputs(comm_, what,
                                strategy::check_backward_outputs(dq, dk, dv, args.tokens));
      });
}

}  // namespace ctxpar
