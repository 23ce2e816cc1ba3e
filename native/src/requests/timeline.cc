// Horovod's timeline (requests/timeline.h): the producers' side (stamp and queue a record) and the
// writer thread (JSON formatting, the rows' nesting, the file).
#include "requests/timeline.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <utility>

#include "requests/message.h"

namespace bagua_hvd {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::string type_title(int32_t type) {
  if (type == kOpAddProcessSet) return "ADD_PROCESS_SET";
  if (type == kOpRemoveProcessSet) return "REMOVE_PROCESS_SET";
  return op_type_name(static_cast<OpType>(type));
}

void append_json_string(std::string* out, const std::string& s) {
  out->push_back('"');
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\u%04x", c);
      out->append(esc);
    } else {
      out->push_back(static_cast<char>(c));
    }
  }
  out->push_back('"');
}

// The row's title: the tensor's name, with its process set when not the global one.
std::string display_name(const std::string& key) {
  const size_t colon = key.find(':');
  if (colon == std::string::npos) return key;
  const std::string set = key.substr(0, colon);
  std::string name = key.substr(colon + 1);
  if (set != "0") name += " (process set " + set + ")";
  return name;
}

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f) std::fclose(f);
  }
};

constexpr const char kTail[] = "\n]\n";  // what closes the array after every flush
constexpr long kTailLen = 3;

// The writer thread's state: the open file and the rows' nesting.
class Sink {
 public:
  bool is_open() const { return file_ != nullptr; }

  Status open(const std::string& path) {
    close(now_ns());
    file_.reset(std::fopen(path.c_str(), "w"));
    if (!file_)
      return Status::InvalidArgument("Error opening the Horovod Timeline file " + path + " (" +
                                     std::strerror(errno) + "), will not write a timeline.");
    path_ = path;
    t0_ns_ = now_ns();
    const int64_t epoch_us = std::chrono::duration_cast<std::chrono::microseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count();
    std::string head =
        "[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": "
        "{\"start_time_since_epoch_in_micros\": " +
        std::to_string(epoch_us) +
        "}},\n{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": 0, "
        "\"args\": {\"sort_index\": 0}}";
    head += kTail;
    write_raw(head, false);
    return Status::OK();
  }

  // Closes every open event, completes the array and the file.
  void close(int64_t ts_ns) {
    if (!file_) return;
    for (auto& kv : rows_) close_all(kv.second, ts_ns, "");
    flush();
    file_.reset();
    rows_.clear();
    groups_.clear();
  }

  // False once a write failed (the file is then closed).
  bool handle(const TimelineRecord& r) {
    if (!file_) return true;
    switch (r.kind) {
      case TimelineRecord::kNegotiateBegin: {
        Row& row = row_of(r.names[0]);
        close_all(row, r.ts_ns, "");
        begin(row, "NEGOTIATE_" + type_title(r.value), r.ts_ns);
        break;
      }
      case TimelineRecord::kNegotiateRank: {
        auto it = rows_.find(r.names[0]);
        if (it == rows_.end() || it->second.depth == 0) break;
        event("X", std::to_string(r.value), r.ts_ns, it->second.pid, ", \"dur\": 0");
        break;
      }
      case TimelineRecord::kNegotiateEnd: {
        auto it = rows_.find(r.names[0]);
        if (it != rows_.end()) close_all(it->second, r.ts_ns, "");
        break;
      }
      case TimelineRecord::kOpBegin: {
        Group& g = groups_[r.group];
        g.dtype = r.dtype;
        const std::string title = type_title(r.value);
        for (const auto& key : r.names) {
          Row& row = row_of(key);
          close_all(row, r.ts_ns, "");
          begin(row, title, r.ts_ns);
          g.rows.push_back(&row);
        }
        break;
      }
      case TimelineRecord::kActivityBegin:
      case TimelineRecord::kActivityEnd: {
        auto it = groups_.find(r.group);
        if (it == groups_.end()) break;
        for (Row* row : it->second.rows) {
          if (row->depth > 1) end(*row, r.ts_ns, "");  // one activity at a time
          if (r.kind == TimelineRecord::kActivityBegin && row->depth == 1)
            begin(*row, r.activity, r.ts_ns);
        }
        break;
      }
      case TimelineRecord::kOpEnd: {
        auto it = groups_.find(r.group);
        if (it == groups_.end()) break;
        std::string args = dtype_arg(it->second.dtype);
        if (r.sent.calls > 0) {
          args += std::string(args.empty() ? "" : ", ") +
                  "\"within_host_bytes_sent\": " + std::to_string(r.sent.within_host) +
                  ", \"between_hosts_bytes_sent\": " + std::to_string(r.sent.between_hosts);
        }
        for (Row* row : it->second.rows) close_all(*row, r.ts_ns, args);
        groups_.erase(it);
        break;
      }
      case TimelineRecord::kCycle:
        instant("CYCLE_START", r.ts_ns, "");
        break;
      default:
        break;
    }
    if (out_.size() > (size_t(1) << 20)) flush();
    return file_ != nullptr;
  }

  void dropped(int64_t ts_ns, int64_t count) {
    if (file_)
      instant("TIMELINE_RECORDS_DROPPED", ts_ns,
              ", \"args\": {\"dropped_so_far\": " + std::to_string(count) + "}");
  }

  // Writes what is pending; the array stays closed after it.
  void flush() {
    if (!file_ || out_.empty()) return;
    out_ += kTail;
    write_raw(out_, true);
    out_.clear();
  }

 private:
  struct Row {
    int pid = 0;
    int depth = 0;  // open B events
  };
  struct Group {
    std::vector<Row*> rows;
    int32_t dtype = -1;
  };

  void write_raw(const std::string& text, bool reopen_array) {
    bool ok = !reopen_array || std::fseek(file_.get(), -kTailLen, SEEK_END) == 0;
    ok = ok && std::fwrite(text.data(), 1, text.size(), file_.get()) == text.size();
    ok = ok && std::fflush(file_.get()) == 0;
    if (!ok) {
      BHVD_LOG(ERROR, "Error writing to the Horovod Timeline " + path_ +
                          " after it was successfully opened, will stop writing the timeline.");
      file_.reset();
      rows_.clear();
      groups_.clear();
    }
  }

  Row& row_of(const std::string& key) {
    auto it = rows_.find(key);
    if (it != rows_.end()) return it->second;
    Row& row = rows_[key];
    row.pid = static_cast<int>(rows_.size());
    const std::string pid = std::to_string(row.pid);
    out_ += ",\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " + pid +
            ", \"args\": {\"name\": ";
    append_json_string(&out_, display_name(key));
    out_ += "}},\n{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": " + pid +
            ", \"args\": {\"sort_index\": " + pid + "}}";
    return row;
  }

  int64_t ts_us(int64_t ts_ns) const { return ts_ns > t0_ns_ ? (ts_ns - t0_ns_) / 1000 : 0; }

  void event(const char* ph, const std::string& name, int64_t ts_ns, int pid,
             const std::string& extra) {
    out_ += ",\n{\"ph\": \"";
    out_ += ph;
    out_ += "\"";
    if (!name.empty()) {
      out_ += ", \"name\": ";
      append_json_string(&out_, name);
    }
    out_ += ", \"ts\": " + std::to_string(ts_us(ts_ns)) + ", \"pid\": " + std::to_string(pid);
    out_ += extra;
    out_ += "}";
  }

  void instant(const char* name, int64_t ts_ns, const std::string& extra) {
    event("i", name, ts_ns, 0, ", \"s\": \"g\"" + extra);
  }

  void begin(Row& row, const std::string& name, int64_t ts_ns) {
    event("B", name, ts_ns, row.pid, "");
    ++row.depth;
  }

  static std::string dtype_arg(int32_t dtype) {
    if (dtype < 0 || !dtype_valid(dtype)) return "";
    return std::string("\"dtype\": \"") + dtype_name(static_cast<DataType>(dtype)) + "\"";
  }

  // args: the members of the event's "args" object, "" for none.
  void end(Row& row, int64_t ts_ns, const std::string& args) {
    event("E", "", ts_ns, row.pid, args.empty() ? "" : ", \"args\": {" + args + "}");
    --row.depth;
  }

  // args: those of the outermost event's end.
  void close_all(Row& row, int64_t ts_ns, const std::string& args) {
    while (row.depth > 0) end(row, ts_ns, row.depth == 1 ? args : "");
  }

  std::unique_ptr<std::FILE, FileCloser> file_;
  std::string path_;
  int64_t t0_ns_ = 0;
  std::unordered_map<std::string, Row> rows_;  // nodes are stable: groups point into them
  std::unordered_map<uint64_t, Group> groups_;
  std::string out_;  // formatted, not yet written
};

}  // namespace

Timeline::Timeline(size_t capacity, int flush_ms)
    : capacity_(capacity < 2 ? 2 : capacity), flush_ms_(flush_ms < 1 ? 1 : flush_ms) {}

Timeline::~Timeline() { shutdown(); }

Status Timeline::start(const std::string& path, bool mark_cycles) {
  std::lock_guard<std::mutex> api(api_mu_);
  mark_cycles_.store(mark_cycles, std::memory_order_relaxed);
  if (active() && path == path_) return Status::OK();
  if (!writer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = false;
    }
    writer_ = std::thread([this] { writer_loop(); });
    name_thread(writer_, "bhvd_timeline");
  }
  active_.store(false, std::memory_order_relaxed);
  TimelineRecord open;
  open.kind = TimelineRecord::kOpen;
  open.names.push_back(path);
  control(std::move(open));
  Status s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = control_status_;
  }
  if (!s.ok()) {
    path_.clear();
    return s;
  }
  path_ = path;
  active_.store(true, std::memory_order_release);
  return Status::OK();
}

void Timeline::stop() {
  std::lock_guard<std::mutex> api(api_mu_);
  if (!writer_.joinable()) return;
  active_.store(false, std::memory_order_release);
  TimelineRecord close;
  close.kind = TimelineRecord::kClose;
  control(std::move(close));
  path_.clear();
}

void Timeline::shutdown() {
  stop();
  std::lock_guard<std::mutex> api(api_mu_);
  if (!writer_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  wake_.notify_one();
  writer_.join();
}

void Timeline::push(TimelineRecord&& r) {
  r.ts_ns = now_ns();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (data_records_ >= capacity_) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      lost_ = true;
      return;
    }
    queue_.push_back(std::move(r));
    wake = ++data_records_ == capacity_ / 2;
  }
  if (wake) wake_.notify_one();
}

void Timeline::control(TimelineRecord&& r) {
  r.ts_ns = now_ns();
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t seq = ++control_seq_;
  r.group = seq;
  queue_.push_back(std::move(r));
  wake_.notify_one();
  done_.wait(lock, [&] { return control_done_ >= seq; });
}

void Timeline::push_tensor(TimelineRecord::Kind kind, const std::string& key, int32_t value) {
  TimelineRecord r;
  r.kind = kind;
  r.value = value;
  r.names.push_back(key);
  push(std::move(r));
}

void Timeline::push_group(TimelineRecord::Kind kind, uint64_t group, const char* activity) {
  if (!group) return;
  TimelineRecord r;
  r.kind = kind;
  r.group = group;
  r.activity = activity;
  push(std::move(r));
}

void Timeline::negotiate_begin(const std::string& key, int32_t op_type) {
  push_tensor(TimelineRecord::kNegotiateBegin, key, op_type);
}

void Timeline::negotiate_rank(const std::string& key, int32_t rank) {
  push_tensor(TimelineRecord::kNegotiateRank, key, rank);
}

void Timeline::negotiate_end(const std::string& key) {
  push_tensor(TimelineRecord::kNegotiateEnd, key, 0);
}

uint64_t Timeline::op_begin(std::vector<std::string> keys, int32_t op_type, int32_t dtype) {
  if (!active()) return 0;
  TimelineRecord r;
  r.kind = TimelineRecord::kOpBegin;
  r.group = next_group_.fetch_add(1, std::memory_order_relaxed);
  r.value = op_type;
  r.dtype = dtype;
  r.names = std::move(keys);
  const uint64_t group = r.group;
  push(std::move(r));
  return group;
}

void Timeline::activity_begin(uint64_t group, const char* activity) {
  push_group(TimelineRecord::kActivityBegin, group, activity);
}

void Timeline::activity_end(uint64_t group) {
  push_group(TimelineRecord::kActivityEnd, group, nullptr);
}

void Timeline::op_end(uint64_t group, const WireCounts& sent) {
  if (!group) return;
  TimelineRecord r;
  r.kind = TimelineRecord::kOpEnd;
  r.group = group;
  r.sent = sent;
  push(std::move(r));
}

void Timeline::mark_cycle() {
  if (!mark_cycles_.load(std::memory_order_relaxed)) return;
  TimelineRecord r;
  r.kind = TimelineRecord::kCycle;
  push(std::move(r));
}

void Timeline::writer_loop() {
  Sink sink;
  std::deque<TimelineRecord> batch;
  int64_t reported_drops = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (queue_.empty()) {
      if (quit_) break;
      wake_.wait_for(lock, std::chrono::milliseconds(flush_ms_));
      continue;
    }
    batch.swap(queue_);
    data_records_ = 0;
    const bool lost = lost_;
    lost_ = false;
    lock.unlock();
    if (lost) {
      reported_drops = dropped_.load(std::memory_order_relaxed);
      sink.dropped(now_ns(), reported_drops);
    }
    for (auto& r : batch) {
      if (r.kind == TimelineRecord::kOpen || r.kind == TimelineRecord::kClose) {
        Status s = Status::OK();
        if (r.kind == TimelineRecord::kOpen) {
          s = sink.open(r.names[0]);
        } else {
          sink.close(r.ts_ns);
        }
        std::lock_guard<std::mutex> guard(mu_);
        control_status_ = s;
        control_done_ = r.group;
        done_.notify_all();
      } else if (!sink.handle(r)) {
        active_.store(false, std::memory_order_relaxed);  // the file failed: stop recording
      }
    }
    sink.flush();
    batch.clear();
    lock.lock();
  }
  lock.unlock();
  sink.close(now_ns());
}

}  // namespace bagua_hvd
