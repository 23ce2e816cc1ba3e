// Objects of the core that a frontend holds by id through the C API (asynchronous averagers,
// low-precision rings): ids from 1, never reused in a process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace bagua_hvd {

template <typename T>
class IdRegistry {
 public:
  int64_t add(std::shared_ptr<T> item) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_++;
    items_[id] = std::move(item);
    return id;
  }
  std::shared_ptr<T> find(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(id);
    return it == items_.end() ? nullptr : it->second;
  }
  // Forgets the item and hands it over (null: unknown), so that the caller ends it unlocked.
  std::shared_ptr<T> remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(id);
    if (it == items_.end()) return nullptr;
    auto item = std::move(it->second);
    items_.erase(it);
    return item;
  }
  // Forgets every item and hands them over.
  std::map<int64_t, std::shared_ptr<T>> remove_all() {
    std::map<int64_t, std::shared_ptr<T>> items;
    std::lock_guard<std::mutex> lock(mu_);
    items.swap(items_);
    return items;
  }
  std::vector<std::shared_ptr<T>> all() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<T>> out;
    for (auto& kv : items_) out.push_back(kv.second);
    return out;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<T>> items_;
  int64_t next_ = 1;
};

}  // namespace bagua_hvd
