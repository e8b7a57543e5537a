// This machine's raw limits for the transports, measured between two processes:
// loopback TCP ping-pong (64 B), TCP echo of 64 MiB, a shared-memory spin ping-pong, memcpy of 64 MiB.
// Build and run:  g++ -O2 -o build/limits examples/reference/limits.cpp && build/limits
// Prints one JSON object; compare a transport's figures with these, measured in the same run.
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>
#include <algorithm>
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b){return std::chrono::duration<double,std::micro>(b-a).count();}
static void full(int fd, char* p, size_t n, bool w){size_t d=0;while(d<n){ssize_t r=w?write(fd,p+d,n-d):read(fd,p+d,n-d); if(r<=0) _exit(1); d+=r;}}
int main(){
  // TCP ping-pong
  int ls=socket(AF_INET,SOCK_STREAM,0); sockaddr_in a{}; a.sin_family=AF_INET; a.sin_addr.s_addr=htonl(INADDR_LOOPBACK); a.sin_port=0;
  int one=1; bind(ls,(sockaddr*)&a,sizeof a); listen(ls,1); socklen_t l=sizeof a; getsockname(ls,(sockaddr*)&a,&l);
  const size_t BIG=64<<20; const int N=5000;
  if(fork()==0){ int c=socket(AF_INET,SOCK_STREAM,0); connect(c,(sockaddr*)&a,sizeof a); setsockopt(c,IPPROTO_TCP,TCP_NODELAY,&one,4);
    char b[64]; for(int i=0;i<N;i++){full(c,b,64,false);full(c,b,64,true);} 
    std::vector<char> big(BIG); for(int i=0;i<5;i++){full(c,big.data(),BIG,false);full(c,big.data(),BIG,true);} _exit(0);}
  int s=accept(ls,0,0); setsockopt(s,IPPROTO_TCP,TCP_NODELAY,&one,4); char b[64]={0};
  std::vector<double> v; for(int i=0;i<N;i++){auto t0=clk::now(); full(s,b,64,true); full(s,b,64,false); v.push_back(us(t0,clk::now()));}
  std::sort(v.begin(),v.end()); double tcp_rtt=v[v.size()/2];
  std::vector<char> big(BIG,1); std::vector<double> bw; for(int i=0;i<5;i++){auto t0=clk::now(); full(s,big.data(),BIG,true); full(s,big.data(),BIG,false); bw.push_back(2.0*BIG/us(t0,clk::now())/1e3);} 
  std::sort(bw.begin(),bw.end()); double tcp_bw=bw[2]; wait(0);
  // shm spin ping-pong
  auto* f=(std::atomic<int>*)mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0); f->store(0);
  const int M=200000;
  if(fork()==0){for(int i=0;i<M;i++){while(f->load(std::memory_order_acquire)!=2*i+1);f->store(2*i+2,std::memory_order_release);} _exit(0);}
  auto t0=clk::now(); for(int i=0;i<M;i++){f->store(2*i+1,std::memory_order_release); while(f->load(std::memory_order_acquire)!=2*i+2);} 
  double shm_rtt=us(t0,clk::now())/M; wait(0);
  // memcpy
  std::vector<char> dst(BIG); std::vector<double> mc; for(int i=0;i<5;i++){auto t0=clk::now(); memcpy(dst.data(),big.data(),BIG); mc.push_back(BIG/us(t0,clk::now())/1e3);} std::sort(mc.begin(),mc.end());
  printf("{\"tcp_pingpong_64B_us\": %.1f, \"tcp_echo_64MiB_GBps\": %.2f, \"shm_spin_pingpong_us\": %.3f, \"memcpy_64MiB_GBps\": %.2f}\n", tcp_rtt, tcp_bw, shm_rtt, mc[2]);
}
