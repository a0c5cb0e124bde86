#include "strategy/call_record.h"

namespace ctxpar::strategy {

CallRecord::CallRecord(Device& device, std::vector<Communicator*> counted)
    : device_(device), counted_(std::move(counted)) {
  for (Communicator* c : counted_) {
    sent0_ += c->counters().bytes_sent;
    received0_ += c->counters().bytes_received;
  }
  device0_ = device_.counters();
  held0_ = device_.held_bytes();
  device_.reset_peak();
  t0_ = now_seconds();
  cpu0_ = thread_cpu_seconds();
}

CallRecord::~CallRecord() {
  if (finished_) return;
  try {
    device_.synchronize();
  } catch (...) {  // the exception in flight says what went wrong first
  }
}

CallMeasure CallRecord::finish() {
  finished_ = true;
  device_.synchronize();
  CallMeasure m;
  for (Communicator* c : counted_) {
    m.bytes_sent += c->counters().bytes_sent;
    m.bytes_received += c->counters().bytes_received;
  }
  m.bytes_sent -= sent0_;
  m.bytes_received -= received0_;
  const DeviceCounters d = device_.counters();
  m.device.flops = d.flops - device0_.flops;
  m.device.busy_seconds = d.busy_seconds - device0_.busy_seconds;
  m.device.wait_seconds = d.wait_seconds - device0_.wait_seconds;
  m.peak_bytes = device_.peak_bytes() - held0_;
  m.wall_seconds = now_seconds() - t0_;
  m.cpu_seconds = thread_cpu_seconds() - cpu0_;
  return m;
}

}  // namespace ctxpar::strategy
